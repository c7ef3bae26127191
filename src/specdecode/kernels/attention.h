// Blocked attention of the native runner, included in the AVX2 and the AVX-512 namespaces of
// cpu_kernels.cpp. Each defines before it:
//   Lanes16          16 floats of a key block or a value row: one __m512, or two __m256 halves
//   zero16, set16, load16 (float or bfloat16), fma16, store16, div16 (by one float)
//   ATTN_PAIRS       the most rows x heads of a pass (two registers' worth of 16 lanes each)
//   ATTN_BLOCKS      16-wide blocks of keys or value columns a pass takes at once
//   ATTN_HEADS       the most query heads of a pass
//   gathered_scores  a row's scores of the keys it names by slot (past its `cached` ones)
//   SOFTMAX_NUMERATORS  scores -> exp(score - max) in place, returning their sum as
//                    generic.h's softmax_numerators does
//
// Attention of a block of R rows of one call for the NH query heads that share one key/value
// head (grouped-query attention); see RowKeys for which keys a row sees. Keys of a row's first
// `cached` positions are read as whole cached blocks of 16, once for every row and head of the
// block; the rest are gathered per row. Every score is one fma chain over the head dimension,
// and every output column one fma chain over the row's keys in logical order, exactly as
// generic.h's attend_one computes them: which rows share a block, and how many, and on which
// instruction set, changes no bit.

// scores of slots j0 .. j0 + 16 B for every row and head of the block (a row's scores past
// its `cached` positions are overwritten by gathered_scores)
template <int NH, int R, int B, typename KV>
static void score_blocks(const RowKeys* rows, const KV* kt, int64_t d, int64_t j0, int64_t end,
                         float* scores, int64_t stride) {
  Lanes16 acc[B][R][NH];
  for (int b = 0; b < B; b++)
    for (int r = 0; r < R; r++)
      for (int h = 0; h < NH; h++) acc[b][r][h] = zero16();
  const KV* blk = kt + (j0 / 16) * d * 16;
  // the key blocks ATTN_PREFETCH passes ahead, a few lines an iteration (none past `end`):
  // `owed` counts lines times d, so that `lines` are spread over the d iterations without a
  // division in the loop (two integer divisions an iteration were a third of this function)
  const char* ahead = (const char*)(blk + ATTN_PREFETCH * B * d * 16);
  const int64_t lines = j0 + ATTN_PREFETCH * B * 16 < end ? B * d * 16 * (int64_t)sizeof(KV) / 64 : 0;
  int64_t owed = 0;
  for (int64_t i = 0; i < d; i++) {
    for (owed += lines; owed >= d; owed -= d, ahead += 64) _mm_prefetch(ahead, _MM_HINT_T0);
    Lanes16 k[B];
    for (int b = 0; b < B; b++) k[b] = load16(blk + (b * d + i) * 16);
    for (int r = 0; r < R; r++)
      for (int h = 0; h < NH; h++) {
        const Lanes16 qi = set16(rows[r].q[h * d + i]);
        for (int b = 0; b < B; b++) acc[b][r][h] = fma16(qi, k[b], acc[b][r][h]);
      }
  }
  for (int b = 0; b < B; b++)
    for (int r = 0; r < R; r++)
      for (int h = 0; h < NH; h++) store16(scores + (r * NH + h) * stride + j0 + 16 * b, acc[b][r][h]);
}

// value columns c0 .. c0 + 16 B of every row and head: positions below `shared` (cached for
// every row of the block) once for all rows, then each row's others
template <int NH, int R, int B, typename KV>
static void value_blocks(const RowKeys* rows, const KV* vc, int64_t d, int64_t shared,
                         int64_t c0, const float* scores, int64_t stride, const float* denom) {
  Lanes16 acc[R][NH][B];
  for (int r = 0; r < R; r++)
    for (int h = 0; h < NH; h++)
      for (int b = 0; b < B; b++) acc[r][h][b] = zero16();
  for (int64_t j = 0; j < shared; j++) {
    if (c0 == 0 && j + ATTN_VALUE_PREFETCH < shared)
      for (int64_t line = 0; line < d * (int64_t)sizeof(KV); line += 64)
        _mm_prefetch((const char*)(vc + (j + ATTN_VALUE_PREFETCH) * d) + line, _MM_HINT_T0);
    Lanes16 v[B];
    for (int b = 0; b < B; b++) v[b] = load16(vc + j * d + c0 + 16 * b);
    for (int r = 0; r < R; r++)
      for (int h = 0; h < NH; h++) {
        const Lanes16 p = set16(scores[(r * NH + h) * stride + j]);
        for (int b = 0; b < B; b++) acc[r][h][b] = fma16(p, v[b], acc[r][h][b]);
      }
  }
  for (int r = 0; r < R; r++) {
    for (int64_t j = shared; j < rows[r].len; j++) {
      const KV* v = vc + slot_of(rows[r], j) * d + c0;
      for (int h = 0; h < NH; h++) {
        const Lanes16 p = set16(scores[(r * NH + h) * stride + j]);
        for (int b = 0; b < B; b++) acc[r][h][b] = fma16(p, load16(v + 16 * b), acc[r][h][b]);
      }
    }
    for (int h = 0; h < NH; h++)
      for (int b = 0; b < B; b++)
        store16(rows[r].out + h * d + c0 + 16 * b, div16(acc[r][h][b], denom[r * NH + h]));
  }
}

// scores: R x NH x stride floats, stride a multiple of 16 at least every row's len
template <int NH, int R, typename KV>
static void attend_block(const RowKeys* rows, const KV* kt, const KV* vc, int64_t d,
                         float* scores, int64_t stride, float cap, const float* sinks) {
  static_assert(R * NH <= ATTN_PAIRS, "a pass holds ATTN_BLOCKS x R x NH accumulators");
  int64_t shared = rows[0].cached, blocked = rows[0].cached;
  for (int r = 1; r < R; r++) {
    shared = std::min(shared, rows[r].cached);
    blocked = std::max(blocked, rows[r].cached);
  }
  blocked = (blocked + 15) / 16 * 16;
  constexpr int wide = 16 * ATTN_BLOCKS;
  int64_t j0 = 0;
  for (; j0 + wide <= blocked; j0 += wide)
    score_blocks<NH, R, ATTN_BLOCKS, KV>(rows, kt, d, j0, blocked, scores, stride);
  for (; j0 < blocked; j0 += 16) score_blocks<NH, R, 1, KV>(rows, kt, d, j0, blocked, scores, stride);
  float denom[R * NH];
  for (int r = 0; r < R; r++) {
    float* sc = scores + r * NH * stride;
    gathered_scores<NH, KV>(rows[r], kt, d, sc, stride);
    for (int h = 0; h < NH; h++) {
      // soft-capping (cap > 0) as attend_one does it: the same elementwise bits
      if (cap > 0.0f) softcap_values(sc + h * stride, sc + h * stride, rows[r].len, cap);
      denom[r * NH + h] = SOFTMAX_NUMERATORS(sc + h * stride, rows[r].len, sinks ? sinks + h : nullptr);
    }
  }
  int64_t c0 = 0;
  for (; c0 + wide <= d; c0 += wide)
    value_blocks<NH, R, ATTN_BLOCKS, KV>(rows, vc, d, shared, c0, scores, stride, denom);
  for (; c0 < d; c0 += 16) value_blocks<NH, R, 1, KV>(rows, vc, d, shared, c0, scores, stride, denom);
}

// the most rows of a block for passes of NH heads
template <int NH>
static constexpr int pass_rows() { return std::min(BLOCK_ROWS_MAX, ATTN_PAIRS / NH); }

// rows of a block per key/value head with nh query heads: as many as its widest pass holds
static inline int64_t block_rows(int64_t nh) {
  return std::min<int64_t>(BLOCK_ROWS_MAX, ATTN_PAIRS / std::min<int64_t>(ATTN_HEADS, nh));
}

// floats of the scores buffer attend_rows takes for nh query heads and rows of `stride` keys
static inline int64_t scores_floats(int64_t nh, int64_t stride) {
  return block_rows(nh) * std::min<int64_t>(ATTN_HEADS, nh) * stride;
}

// attend_block of `count` rows (at most R), instantiated from R down to 1
template <int NH, int R, typename KV>
static void attend_count(int64_t count, const RowKeys* rows, const KV* kt, const KV* vc, int64_t d,
                         float* scores, int64_t stride, float cap, const float* sinks) {
  if constexpr (R > 1) {
    if (count < R) return attend_count<NH, R - 1, KV>(count, rows, kt, vc, d, scores, stride, cap, sinks);
  }
  attend_block<NH, R, KV>(rows, kt, vc, d, scores, stride, cap, sinks);
}

// a pass of `heads` (at most NH) query heads, instantiated from NH down to 1
template <int NH, typename KV>
static void attend_heads(int64_t heads, const RowKeys* rows, int64_t count, const KV* kt,
                         const KV* vc, int64_t d, float* scores, int64_t stride, float cap,
                         const float* sinks) {
  if constexpr (NH > 1) {
    if (heads < NH)
      return attend_heads<NH - 1, KV>(heads, rows, count, kt, vc, d, scores, stride, cap, sinks);
  }
  attend_count<NH, pass_rows<NH>(), KV>(count, rows, kt, vc, d, scores, stride, cap, sinks);
}

// `count` rows (at most block_rows(nh)) for the nh heads that share a key/value head,
// ATTN_HEADS heads a pass; a row's q and out point at its first head of the group. scores:
// scores_floats(nh, stride) floats. sinks: the nh heads' attention sinks (null: none).
template <typename KV>
static void attend_rows(const RowKeys* rows, int64_t count, const KV* kt, const KV* vc,
                        int64_t d, float* scores, int64_t stride, int64_t nh, float cap,
                        const float* sinks) {
  RowKeys part[BLOCK_ROWS_MAX];
  for (int64_t h = 0; h < nh; h += ATTN_HEADS) {
    for (int64_t r = 0; r < count; r++)
      part[r] = {rows[r].q + h * d, rows[r].out + h * d, rows[r].slots, rows[r].cached, rows[r].len};
    attend_heads<ATTN_HEADS, KV>(std::min<int64_t>(ATTN_HEADS, nh - h), part, count, kt, vc, d,
                                 scores, stride, cap, sinks ? sinks + h : nullptr);
  }
}
