// Top-k entry selection of the Lightning Indexer (topk_select): one CTA or a thread-block cluster per query row, see
// topk.cu.
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
constexpr int kTopkCtaMaxN = 32768;     // the one-CTA kernel's rows (16-bit scores): keys + histogram in shared memory

// the CTAs of one row's cluster for `rows` rows of N entries (1, 2, 4 or 8; 16 past 16K entries where the current
// device holds `rows` clusters of 16 at once)
int topk_select_cluster(int N, int rows);

constexpr int kTopkCtaMinRows = 9;      // the one-CTA kernel's calls by default: prefill chunks of at least
constexpr int kTopkCtaMinN = 4096;      // 4K entries (a decode row of 32K entries: 9.6 us on the clusters against
                                        // 19.2; 128 rows of 256 entries: 7.9 against 15.7)

// which kernel takes a call: 0 the one-CTA kernel (16-bit scores, N <= kTopkCtaMaxN), 1 the clusters; mode 0 picks
// (the one-CTA kernel where it applies to kTopkCtaMinRows rows or more of kTopkCtaMinN entries or more), 1 forces the
// clusters, 2 the one-CTA kernel (-1: it does not apply)
int topk_select_path(int N, int kind, int rows, int mode);

// one CTA of 1024 threads per row (path 0) or grid C x rows (C = topk_select_cluster(N, rows)); 1 <= K <= min(N,
// kTopkMaxK), N <= kTopkMaxN, rows <= kTopkMaxRows (checked by the binding)
cudaError_t topk_select_launch(const TopkArgs& a, int rows, int mode, bool pdl, cudaStream_t stream);

}  // namespace dsv4
