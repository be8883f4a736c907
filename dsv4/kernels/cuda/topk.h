// Top-k entry selection of the Lightning Indexer (topk_select): a thread-block cluster per query row, see topk.cu.
#pragma once
#include <cuda_runtime.h>

namespace dsv4 {

struct TopkArgs {
  const void* x;                     // scores [B, S, N]: bf16 (kind 0), f16 (kind 1) or fp32 (kind 2), unit stride on N
  const void* nvis;                  // [S] int64 (nvis_i64) or int32: entries 0..nvis[s]-1 visible to query s
  int* o;                            // [B, S, K] int32, unit stride on K
  long long sx_b, sx_s, so_b, so_s;  // element strides
  int S, N, K, kind, nvis_i64;
};

constexpr int kTopkMaxK = 1024;         // a list of at most this many entries per row
constexpr int kTopkMaxN = 256 * 1024;   // entries of one row: 8 CTAs x 32K keys in shared memory (1M tokens / 4)
constexpr int kTopkMaxRows = 65535;     // rows (B * S): the grid's second dimension

// the CTAs of one row's cluster for `rows` rows of N entries (1, 2, 4 or 8; 16 past 16K entries where the current
// device holds `rows` clusters of 16 at once)
int topk_select_cluster(int N, int rows);

// grid: C x rows (C = topk_select_cluster(N, rows)); 1 <= K <= min(N, kTopkMaxK), N <= kTopkMaxN, rows <= kTopkMaxRows
// (checked by the binding)
cudaError_t topk_select_launch(const TopkArgs& a, int rows, bool pdl, cudaStream_t stream);

}  // namespace dsv4
