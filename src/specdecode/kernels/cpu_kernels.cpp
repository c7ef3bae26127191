// CPU kernels of the native runner (specdecode.kernels builds and loads this file).
//
// Every kernel is row-invariant by construction: see generic.h for the rule. The instruction
// set is chosen at run time (AMX tiles for the int4 linears of several rows, amx.h; AVX-512
// with VNNI; AVX2 + FMA; or baseline x86-64); the integer dot products are exact and the float
// operations are the same sequence in every variant, so the variants agree bit for bit as well. Threads split output columns (or attention rows and
// heads), never a sum.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <type_traits>
#include <utility>
#include <vector>

#define FMA __builtin_fmaf
#define Q4_BLOCK 320  // bytes per (16-column tile, 32-input group): 256 of codes, 2 x 32 of scales
// how far ahead of the block in use the Q4 kernel asks for weights: a tile's first row block
// streams them from memory, and the hardware prefetcher alone leaves it waiting (measured)
#define Q4_PREFETCH (12 * Q4_BLOCK)
// the fewest rows for which the Q4 kernel takes the AMX tiles (measured: scripts/amx_rows.py)
#define AMX_MIN_ROWS 7
// how far ahead attention asks for keys (passes of its score loop) and values (slots): the
// hardware prefetcher alone leaves a decode row's long context waiting on memory (measured:
// 8-21% of attention at 300-1600 cached positions: scripts/attention_costs.py, which
// builds the kernels with both set to 0 beside these)
#ifndef ATTN_PREFETCH
#define ATTN_PREFETCH 2
#endif
#ifndef ATTN_VALUE_PREFETCH
#define ATTN_VALUE_PREFETCH 16
#endif
// rows a thread's share of the row-wise kernels (norms, gating, rotary embedding) holds at
// least: fewer rows run on the calling thread, as a decode step's do. (16, which left a verify
// step of 12 to 16 rows on one thread while the other waited, took 1.02-1.04x the time of 8
// at those rows: the 1.5B after 256 positions on a Zen 5, scripts/kernels_ab.py; 4 gained
// nothing over 8 at 4 to 16 rows.)
#define ROW_GRAIN 8

// Where pass `pass` of `passes` over a tile asks for the next tiles' weights (`lines` cache
// lines from `next`): spread evenly over the groups of the passes after the first, so that they
// arrive while those passes compute from cache. {null, 0}: the first pass (it asks for its own
// stream), no next tiles, or none left to ask for. The row kernels' passes (Q4, block int8,
// small codes) share it, on every ISA.
struct Ahead {
  const uint8_t* at;
  int64_t lines;  // a group
};
static inline Ahead ahead_of_pass(int64_t pass, int64_t passes, const uint8_t* next,
                                  int64_t lines, int64_t groups) {
  const int64_t per_group = passes > 1 ? (lines + (passes - 1) * groups - 1) / ((passes - 1) * groups) : 0;
  const int64_t first_line = (pass - 1) * groups * per_group;
  if (pass == 0 || !next || first_line >= lines) return {nullptr, 0};
  // the last pass's share may run past the next tiles: ask for no more than they hold
  return {next + first_line * 64, std::min(per_group, (lines - first_line) / groups)};
}

// One row of a blocked attention call (attention.h): its keys are positions 0..len-1; its
// first `cached` positions sit in the cache slot of the same number (the committed context, and
// a chain's or a tree path's rows written in order), the rest in the slots it names (its tree
// ancestors). Head sizes for which blocks_fit(d).
struct RowKeys {
  const float* q;        // the row's query heads of one key/value head, [NH][D]
  float* out;            // [NH][D]
  const int32_t* slots;  // slots of positions cached, cached + 1, .. len - 1
  int64_t cached;        // positions 0 .. cached - 1 sit in slots 0 .. cached - 1
  int64_t len;           // positions the row sees
};

static inline bool blocks_fit(int64_t d) { return d % 16 == 0 && d <= 256; }
// the most rows of a block (its RowKeys arrays hold this many)
constexpr int BLOCK_ROWS_MAX = 4;

static inline int64_t slot_of(const RowKeys& row, int64_t j) {
  return j < row.cached ? j : row.slots[j - row.cached];
}

#define WEIGHT_LOADERS                                                    \
  static inline float load_weight(float w) { return w; }                  \
  static inline float load_weight(int8_t w) { return (float)w; }          \
  static inline float load_weight(uint16_t w) { /* bfloat16 bits */       \
    uint32_t bits = (uint32_t)w << 16;                                    \
    float f;                                                              \
    std::memcpy(&f, &bits, 4);                                            \
    return f;                                                             \
  }

// exp_fixed of generic.h in the vector registers of W bits (intrinsics prefix P: _mm256,
// _mm512): the same operations in the same order, so each lane gives exp_fixed's bits
#define EXP_LANES(NAME, W, P)                                                                   \
  static inline __m##W NAME(__m##W x) {                                                         \
    x = P##_min_ps(P##_max_ps(x, P##_set1_ps(-87.0f)), P##_set1_ps(88.0f));                     \
    const __m##W magic = P##_set1_ps(12582912.0f);                                              \
    const __m##W n = P##_sub_ps(P##_add_ps(P##_mul_ps(x, P##_set1_ps(1.44269504088896341f)),   \
                                           magic), magic);                                      \
    __m##W r = P##_fmadd_ps(n, P##_set1_ps(-0.693359375f), x);                                  \
    r = P##_fmadd_ps(n, P##_set1_ps(2.12194440e-4f), r);                                        \
    __m##W p = P##_set1_ps(1.9875691500e-4f);                                                   \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.3981999507e-3f));                                      \
    p = P##_fmadd_ps(p, r, P##_set1_ps(8.3334519073e-3f));                                      \
    p = P##_fmadd_ps(p, r, P##_set1_ps(4.1665795894e-2f));                                      \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.6666665459e-1f));                                      \
    p = P##_fmadd_ps(p, r, P##_set1_ps(5.0000001201e-1f));                                      \
    p = P##_add_ps(P##_fmadd_ps(p, P##_mul_ps(r, r), r), P##_set1_ps(1.0f));                    \
    const __m##W##i bits =                                                                      \
        P##_slli_epi32(P##_add_epi32(P##_cvttps_epi32(n), P##_set1_epi32(127)), 23);            \
    return P##_mul_ps(p, P##_castsi##W##_ps(bits));                                             \
  }

#define DENSE_TILE dense_tile
#define EXP_SCALED exp_scaled
#define SWIGLU_SPAN swiglu_span
#define ROW_MAX row_max
#define NEXT_ABOVE next_above
namespace k_generic {
WEIGHT_LOADERS
#include "generic.h"
}  // namespace k_generic

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#undef SWIGLU_SPAN
#define SWIGLU_SPAN swiglu_span_avx2
#undef EXP_SCALED
#define EXP_SCALED exp_scaled_avx2
namespace k_avx2 {
WEIGHT_LOADERS
EXP_LANES(exp8, 256, _mm256)

// lanes 0 .. count - 1 of 8 set (all of them from 8 on): a mask for VMASKMOVPS
static inline __m256i first_lanes(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)std::min<int64_t>(8, count)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// generic.h's exp_scaled, 8 lanes a step
static void exp_scaled_avx2(const float* x, float* e, int64_t n, float temperature, float top) {
  const __m256 t = _mm256_set1_ps(temperature), shift = _mm256_set1_ps(top);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(e + i, exp8(_mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), t), shift)));
  if (i < n) {
    const __m256i live = first_lanes(n - i);
    _mm256_maskstore_ps(e + i, live, exp8(_mm256_sub_ps(_mm256_div_ps(_mm256_maskload_ps(x + i, live), t), shift)));
  }
}

// generic.h's swiglu_span, 8 lanes a step (GCC leaves the scalar loop unvectorised: 6 ns an
// element on a Zen 3)
static inline __m256 swiglu8(__m256 gate, __m256 up) {
  const __m256 e = exp8(_mm256_xor_ps(gate, _mm256_set1_ps(-0.0f)));  // exp(-gate)
  return _mm256_div_ps(_mm256_mul_ps(gate, up), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}
static void swiglu_span_avx2(const float* g, const float* u, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, swiglu8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
  if (i < n) {
    const __m256i live = first_lanes(n - i);
    _mm256_maskstore_ps(y + i, live, swiglu8(_mm256_maskload_ps(g + i, live), _mm256_maskload_ps(u + i, live)));
  }
}

#include "generic.h"
#include "q4_avx2.h"

// attention.h's 16 lanes: two registers of 8
struct Lanes16 {
  __m256 lo, hi;
};
static inline Lanes16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline Lanes16 set16(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline Lanes16 load16(const float* w) { return {_mm256_loadu_ps(w), _mm256_loadu_ps(w + 8)}; }
static inline __m256 bf16_8(const uint16_t* w) {  // bfloat16: the high half of a float32
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline Lanes16 load16(const uint16_t* w) { return {bf16_8(w), bf16_8(w + 8)}; }
static inline Lanes16 fma16(Lanes16 a, Lanes16 b, Lanes16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline void store16(float* at, Lanes16 v) {
  _mm256_storeu_ps(at, v.lo);
  _mm256_storeu_ps(at + 8, v.hi);
}
static inline Lanes16 div16(Lanes16 v, float by) {
  const __m256 d = _mm256_set1_ps(by);
  return {_mm256_div_ps(v.lo, d), _mm256_div_ps(v.hi, d)};
}
// R x NH <= 6: a pass keeps one 16-wide block for every row and head in 12 of the 16
// registers; up to 6 heads a pass, so that a decode row of a group of 6 (Qwen2.5's 1.5B)
// reads each key and value once
#define ATTN_PAIRS 6
#define ATTN_BLOCKS 1
#define ATTN_HEADS 6

// one row's scores of positions row.cached .. len (its own rows in a tree: a few), a key at a
// time (generic.h's key_score)
template <int NH, typename KV>
static void gathered_scores(const RowKeys& row, const KV* kt, int64_t d, float* scores,
                            int64_t stride) {
  for (int64_t j = row.cached; j < row.len; j++)
    for (int h = 0; h < NH; h++) scores[h * stride + j] = key_score(row.q + h * d, kt, slot_of(row, j), d);
}

// generic.h's softmax_numerators, 8 lanes a step: the sum through the same 16 lanes in the same
// order, as two registers of 8 (the maximum is exact in any order). Lanes past `len` add 0.
static float softmax_numerators_avx2(float* sc, int64_t len, const float* sink) {
  const float most = ROW_MAX(sc, len);
  const float mx = sink && *sink > most ? *sink : most;
  const __m256 top = _mm256_set1_ps(mx);
  __m256 part[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  // lanes 0-7 and 8-15 of 16
  int64_t j = 0;
  for (; j + 8 <= len; j += 8) {
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), top));
    _mm256_storeu_ps(sc + j, p);
    part[(j / 8) % 2] = _mm256_add_ps(part[(j / 8) % 2], p);
  }
  if (j < len) {
    const __m256i live = first_lanes(len - j);
    const __m256 p = exp8(_mm256_sub_ps(_mm256_maskload_ps(sc + j, live), top));
    _mm256_maskstore_ps(sc + j, live, p);
    part[(j / 8) % 2] = _mm256_add_ps(part[(j / 8) % 2], _mm256_and_ps(p, _mm256_castsi256_ps(live)));
  }
  alignas(32) float lanes[16];
  _mm256_store_ps(lanes, part[0]);
  _mm256_store_ps(lanes + 8, part[1]);
  return sink ? tree16(lanes) + exp_fixed(*sink - mx) : tree16(lanes);
}
#define SOFTMAX_NUMERATORS softmax_numerators_avx2

#include "attention.h"
#undef ATTN_PAIRS
#undef ATTN_BLOCKS
#undef ATTN_HEADS
#undef SOFTMAX_NUMERATORS

// quantise_rows (below) with 256-bit registers: the same operations, so the same bytes
template <int G>
static void quantise_rows_avx2(const float* x, int64_t r0, int64_t r1, int64_t k, int8_t* xq,
                               float* dx, float* sx) {
  const int64_t groups = k / G;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
  for (int64_t r = r0; r < r1; r++)
    for (int64_t g = 0; g < groups; g++) {
      const float* xg = x + r * k + g * G;
      __m256 amaxes = _mm256_setzero_ps();
      for (int i = 0; i < G; i += 8)
        amaxes = _mm256_max_ps(amaxes, _mm256_and_ps(_mm256_loadu_ps(xg + i), magnitude));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, amaxes);
      float amax = lanes[0];
      for (int i = 1; i < 8; i++) amax = std::max(amax, lanes[i]);
      const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      __m256i totals = _mm256_setzero_si256();
      for (int i = 0; i < G; i += 8) {
        // round to nearest even, as nearbyint does in the default rounding mode
        const __m256i q = _mm256_max_epi32(
            bottom, _mm256_min_epi32(top, _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + i), inv))));
        const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(xq + r * k + g * G + i), _mm_packs_epi16(words, words));
        totals = _mm256_add_epi32(totals, q);
      }
      alignas(32) int32_t sums[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(sums), totals);
      int32_t total = 0;
      for (int i = 0; i < 8; i++) total += sums[i];
      dx[r * groups + g] = amax / 127.0f;
      if (sx) sx[r * groups + g] = dx[r * groups + g] * (float)total;
    }
}
}  // namespace k_avx2
#pragma GCC pop_options
#undef SWIGLU_SPAN
#define SWIGLU_SPAN swiglu_span

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#undef DENSE_TILE
#define DENSE_TILE dense_tile_avx512
#undef EXP_SCALED
#define EXP_SCALED exp_scaled_avx512
#undef ROW_MAX
#define ROW_MAX row_max_avx512
#undef NEXT_ABOVE
#define NEXT_ABOVE next_above_avx512
namespace k_avx512 {
WEIGHT_LOADERS

static inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
static inline __m512 load16(const uint16_t* w) {  // bfloat16: the high half of a float32
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
static inline __m512 load16(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}

// generic.h's dense_tile with the 16 columns in one register: the same fma per input
template <typename W, int R>
static void dense_tile_avx512(const float* x, int64_t k_dim, const W* w, float* acc_out) {
  __m512 a[R];
  for (int r = 0; r < R; r++) a[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_dim; k++) {
    const __m512 wv = load16(w + k * 16);
    for (int r = 0; r < R; r++) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * k_dim + k]), wv, a[r]);
  }
  for (int r = 0; r < R; r++) _mm512_storeu_ps(acc_out + 16 * r, a[r]);
}

EXP_LANES(exp16, 512, _mm512)

// generic.h's row_max, its 16 lanes in one register (the largest value does not depend on
// the order it is looked for in)
static float row_max_avx512(const float* x, int64_t v) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 16 <= v; i += 16) top = _mm512_max_ps(_mm512_loadu_ps(x + i), top);
  const __mmask16 rest = (__mmask16)((1u << (v - i)) - 1);
  top = _mm512_mask_max_ps(top, rest, _mm512_maskz_loadu_ps(rest, x + i), top);
  return _mm512_reduce_max_ps(top);
}

// generic.h's next_above, 16 values a compare
static int64_t next_above_avx512(const float* e, int64_t from, int64_t v, float threshold) {
  const __m512 t = _mm512_set1_ps(threshold);
  for (; from + 16 <= v; from += 16) {
    const __mmask16 above = _mm512_cmp_ps_mask(_mm512_loadu_ps(e + from), t, _CMP_GT_OQ);
    if (above) return from + __builtin_ctz(above);
  }
  while (from < v && !(e[from] > threshold)) from++;
  return from;
}

// generic.h's exp_scaled, 16 lanes a step
static void exp_scaled_avx512(const float* x, float* e, int64_t n, float temperature, float top) {
  const __m512 t = _mm512_set1_ps(temperature), shift = _mm512_set1_ps(top);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(e + i, exp16(_mm512_sub_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), t), shift)));
  const __mmask16 rest = (__mmask16)((1u << (n - i)) - 1);
  _mm512_mask_storeu_ps(e + i, rest,
                        exp16(_mm512_sub_ps(_mm512_div_ps(_mm512_maskz_loadu_ps(rest, x + i), t), shift)));
}

#include "generic.h"

// attention.h's 16 lanes: one register
using Lanes16 = __m512;
static inline __m512 zero16() { return _mm512_setzero_ps(); }
static inline __m512 set16(float x) { return _mm512_set1_ps(x); }
static inline __m512 fma16(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
static inline void store16(float* at, __m512 v) { _mm512_storeu_ps(at, v); }
static inline __m512 div16(__m512 v, float by) { return _mm512_div_ps(v, _mm512_set1_ps(by)); }
// R x NH <= 12, so a pass keeps two 16-wide blocks (of keys, or of value columns) for every
// row and head in 24 registers
#define ATTN_PAIRS 12
#define ATTN_BLOCKS 2
#define ATTN_HEADS 4

// 16 keys' element i, gathered from the cache at elements at[l] + 16 i
static inline __m512 gather16(const float* kt, __m512i at, int64_t i) {
  return _mm512_i32gather_ps(at, kt + i * 16, 4);
}
// bfloat16 cache: the 32-bit words holding the elements (a word never reaches past the cache),
// each element moved to the high half of its lane (an even element is its word's low half)
static inline __m512 gather16(const uint16_t* kt, __m512i at, int64_t i) {
  const __m512i words = _mm512_i32gather_epi32(_mm512_srli_epi32(at, 1), kt + i * 16, 4);
  const __m512i odd = _mm512_and_si512(at, _mm512_set1_epi32(1));
  const __m512i shift = _mm512_slli_epi32(_mm512_xor_si512(odd, _mm512_set1_epi32(1)), 4);
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_sllv_epi32(words, shift),
                                              _mm512_set1_epi32((int)0xffff0000u)));
}

// one row's scores of positions row.cached .. len, 16 keys a register gathered from their slots
template <int NH, typename KV>
static void gathered_scores(const RowKeys& row, const KV* kt, int64_t d, float* scores,
                            int64_t stride) {
  for (int64_t j0 = row.cached; j0 < row.len; j0 += 16) {
    const int64_t count = std::min<int64_t>(16, row.len - j0);
    const __mmask16 live = (__mmask16)((1u << count) - 1);
    alignas(64) int32_t idx[16];
    for (int l = 0; l < 16; l++)
      idx[l] = (int32_t)key_at(slot_of(row, j0 + std::min<int64_t>(l, count - 1)), 0, d);
    const __m512i at = _mm512_load_si512(idx);
    __m512 acc[NH];
    for (int h = 0; h < NH; h++) acc[h] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i++) {
      const __m512 k = gather16(kt, at, i);
      for (int h = 0; h < NH; h++) acc[h] = _mm512_fmadd_ps(_mm512_set1_ps(row.q[h * d + i]), k, acc[h]);
    }
    for (int h = 0; h < NH; h++) _mm512_mask_storeu_ps(scores + h * stride + j0, live, acc[h]);
  }
}

// generic.h's softmax_numerators, 16 lanes a step: the sum through the same 16 lanes in the
// same order (the maximum is exact in any order)
static float softmax_numerators_avx512(float* sc, int64_t len, const float* sink) {
  const float most = row_max_avx512(sc, len);
  const float mx = sink && *sink > most ? *sink : most;
  const __m512 top = _mm512_set1_ps(mx);
  __m512 part = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; j += 16) {
    const __mmask16 live = (__mmask16)((1u << std::min<int64_t>(16, len - j)) - 1);
    const __m512 p = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sc + j), top));
    _mm512_mask_storeu_ps(sc + j, live, p);
    part = _mm512_mask_add_ps(part, live, part, p);
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, part);
  return sink ? tree16(lanes) + exp_fixed(*sink - mx) : tree16(lanes);
}
#define SOFTMAX_NUMERATORS softmax_numerators_avx512

#include "attention.h"

// The Q4 kernel with VPDPBUSD: R rows x T column tiles per pass, so each unpacked block of
// codes serves R rows and each broadcast of four activation bytes serves T tiles. A group's
// integer sums are exact whatever the order; its two float folds come in group order.
// `ahead`: where the rows after a tile's first pass ask for the next tiles' weights, `ahead_lines`
// cache lines a group, so that they arrive while this pass computes from cache (null: the first
// pass, which asks for its own stream Q4_PREFETCH ahead)
template <int R, int T>
static void q4_tiles_vnni(const int8_t* xq, const float* dx, const float* sx, int64_t k_dim,
                          const uint8_t* tile, int64_t tile_bytes, const uint8_t* ahead,
                          int64_t ahead_lines, __m512 (&acc)[R][T]) {
  const int64_t groups = k_dim / 32;
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int r = 0; r < R; r++)
    for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    __m512i sum[R][T];
    for (int r = 0; r < R; r++)
      for (int t = 0; t < T; t++) sum[r][t] = _mm512_setzero_si512();
    if (ahead) {
      for (int64_t line = 0; line < ahead_lines; line++)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + (g * ahead_lines + line) * 64), _MM_HINT_T0);
    } else {
      for (int t = 0; t < T; t++)
        for (int line = 0; line < Q4_BLOCK; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(tile + t * tile_bytes + g * Q4_BLOCK +
                                                     Q4_PREFETCH + line), _MM_HINT_T0);
    }
    for (int j = 0; j < 4; j++) {
      __m512i lo[T], hi[T];
      for (int t = 0; t < T; t++) {
        const __m512i v = _mm512_loadu_si512(tile + t * tile_bytes + g * Q4_BLOCK + 64 * j);
        lo[t] = _mm512_and_si512(v, low);
        hi[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      for (int r = 0; r < R; r++) {
        const int8_t* xg = xq + r * k_dim + g * 32;
        int32_t a, b;
        std::memcpy(&a, xg + 4 * j, 4);
        std::memcpy(&b, xg + 16 + 4 * j, 4);
        const __m512i xa = _mm512_set1_epi32(a), xb = _mm512_set1_epi32(b);
        for (int t = 0; t < T; t++) {
          sum[r][t] = _mm512_dpbusd_epi32(sum[r][t], lo[t], xa);
          sum[r][t] = _mm512_dpbusd_epi32(sum[r][t], hi[t], xb);
        }
      }
    }
    for (int t = 0; t < T; t++) {
      const uint8_t* blk = tile + t * tile_bytes + g * Q4_BLOCK;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 256)));
      const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 288)));
      for (int r = 0; r < R; r++) {
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[r * groups + g]));
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][t]), scale, acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sx[r * groups + g]), acc[r][t]);
      }
    }
  }
}

// `rows` (1..R) as a compile-time count: use(std::integral_constant<int, rows>)
template <int R, class Use>
static inline void with_rows(int64_t rows, Use&& use) {
  if constexpr (R > 1)
    if (rows < R) return with_rows<R - 1>(rows, use);
  use(std::integral_constant<int, R>{});
}

// m rows in passes of P (the last takes what is left), pass(R, r0, ahead) for each, R the
// pass's row count at compile time, `ahead` where it asks for `next` (ahead_of_pass over
// `lines` cache lines); the VNNI row kernels' passes (Q4, block int8, small codes)
template <int P, class Pass>
static inline void row_passes(int64_t m, const uint8_t* next, int64_t lines, int64_t groups,
                              Pass&& pass) {
  for (int64_t r0 = 0; r0 < m; r0 += P) {
    const Ahead ahead = ahead_of_pass(r0 / P, (m + P - 1) / P, next, lines, groups);
    with_rows<P>(std::min<int64_t>(P, m - r0), [&](auto rows) { pass(rows, r0, ahead); });
  }
}

// the most rows that take a column tile in one pass of the VNNI row kernels: each unpacked
// slice (each block int8 group's bytes) serves them all and the tile streams once. More rows
// take two tiles a pass, in passes of 4. (Whole forwards on a Zen 4 after 256 positions, one
// pass against passes of 4 over two tiles, 5 to 8 rows: the 1.5B's Q4_K and Q6_K 0.84-0.97x
// the time, the 0.5B's Q5_0, Q8_0, Q4_K and Q6_K 0.86-0.89x, SmolLM2 in int4 0.81-0.92x; passes
// of up to 8 over one tile for 10 to 64 rows and prompts: 0.99-1.10x)
#ifndef VNNI_ONE_PASS_ROWS
#define VNNI_ONE_PASS_ROWS 8
#endif

// y[rows, tile columns] = residual + acc, as store_tile does, 16 columns a store
template <int R, int T>
static void store_tiles(const __m512 (&acc)[R][T], int rows, int64_t r0, int64_t t0, int64_t n,
                        const float* residual, float* y) {
  for (int r = 0; r < rows; r++)
    for (int t = 0; t < T; t++) {
      const int64_t col = (t0 + t) * 16, at = (r0 + r) * n + col;
      const __mmask16 live = (__mmask16)((1u << std::min<int64_t>(16, n - col)) - 1);
      __m512 v = acc[r][t];
      if (residual) v = _mm512_add_ps(_mm512_maskz_loadu_ps(live, residual + at), v);
      _mm512_mask_storeu_ps(y + at, live, v);
    }
}

// rows in passes of P over T column tiles; `next`: the tiles this thread reads after these
// (null if none), whose weights the passes after the first ask for
template <int T, int P>
static void q4_rows_vnni(const int8_t* xq, const float* dx, const float* sx, int64_t m,
                         int64_t k_dim, const uint8_t* tile, const uint8_t* next, int64_t t,
                         const float* residual, float* y, int64_t n) {
  const int64_t groups = k_dim / 32, tile_bytes = groups * Q4_BLOCK;
  row_passes<P>(m, next, T * tile_bytes / 64, groups, [&](auto rows, int64_t r0, Ahead ahead) {
    constexpr int R = decltype(rows)::value;
    __m512 acc[R][T];
    q4_tiles_vnni<R, T>(xq + r0 * k_dim, dx + r0 * groups, sx + r0 * groups, k_dim, tile,
                        tile_bytes, ahead.at, ahead.lines, acc);
    store_tiles<R, T>(acc, R, r0, t, n, residual, y);
  });
}

static void q4_columns_vnni(const int8_t* xq, const float* dx, const float* sx, int64_t m,
                            int64_t k_dim, const uint8_t* packed, const float* residual,
                            float* y, int64_t n, int64_t t0, int64_t t1) {
  const int64_t tile_bytes = k_dim / 32 * Q4_BLOCK;
  int64_t t = t0;
  // two tiles a pass where rows are many enough to be bound by arithmetic; one stream of
  // weights where few rows make it bound by memory (measured: two streams cost 40% there)
  for (; m > VNNI_ONE_PASS_ROWS && t + 2 <= t1; t += 2)
    q4_rows_vnni<2, 4>(xq, dx, sx, m, k_dim, packed + t * tile_bytes,
                       t + 4 <= t1 ? packed + (t + 2) * tile_bytes : nullptr, t, residual, y, n);
  for (; t < t1; t++)
    q4_rows_vnni<1, VNNI_ONE_PASS_ROWS>(xq, dx, sx, m, k_dim, packed + t * tile_bytes,
                                        t + 2 <= t1 ? packed + (t + 1) * tile_bytes : nullptr, t,
                                        residual, y, n);
}

// quantise_rows (below) with 512-bit registers: the same operations, so the same bytes
template <int G>
static void quantise_rows_avx512(const float* x, int64_t r0, int64_t r1, int64_t k, int8_t* xq,
                                 float* dx, float* sx) {
  const int64_t groups = k / G;
  const __m512i top = _mm512_set1_epi32(127), bottom = _mm512_set1_epi32(-127);
  for (int64_t r = r0; r < r1; r++)
    for (int64_t g = 0; g < groups; g++) {
      const float* xg = x + r * k + g * G;
      __m512 amaxes = _mm512_setzero_ps();
      for (int i = 0; i < G; i += 16) amaxes = _mm512_max_ps(amaxes, _mm512_abs_ps(_mm512_loadu_ps(xg + i)));
      const float amax = _mm512_reduce_max_ps(amaxes);
      const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      __m512i totals = _mm512_setzero_si512();
      for (int i = 0; i < G; i += 16) {
        // round to nearest even, as nearbyint does in the default rounding mode
        const __m512i q = _mm512_max_epi32(
            bottom, _mm512_min_epi32(top, _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg + i), inv))));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + r * k + g * G + i), _mm512_cvtepi32_epi8(q));
        totals = _mm512_add_epi32(totals, q);
      }
      dx[r * groups + g] = amax / 127.0f;
      if (sx) sx[r * groups + g] = dx[r * groups + g] * (float)_mm512_reduce_add_epi32(totals);
    }
}

}  // namespace k_avx512
#pragma GCC pop_options
#undef DENSE_TILE

#include "amx.h"

// q8_blocks.h (included below: it needs the activation quantisers above it)
at::Tensor q8_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t group,
                     bool minimum, bool half, const c10::optional<at::Tensor>& residual,
                     int64_t n, int64_t isa);
// small_codes.h (included below, beside q8_blocks.h)
at::Tensor small_codes_linear(const at::Tensor& x, const at::Tensor& packed, int64_t layout,
                              bool minimum, const c10::optional<at::Tensor>& residual, int64_t n,
                              int64_t isa, double input_scale,
                              const c10::optional<at::Tensor>& codebook, int64_t scaled_columns);

namespace {

enum Isa { GENERIC = 0, AVX2 = 1, AVX512 = 2, AMX = 3 };

int detect_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vnni"))
    return k_amx::amx_usable() ? AMX : AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AVX2;
  return GENERIC;
}

#define DISPATCH(isa, fn, ...)                          \
  do {                                                  \
    if ((isa) >= AVX512) k_avx512::fn(__VA_ARGS__);     \
    else if ((isa) == AVX2) k_avx2::fn(__VA_ARGS__);    \
    else k_generic::fn(__VA_ARGS__);                    \
  } while (0)

void check_rows(const at::Tensor& x, int64_t k, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == k,
              what, ": expected a contiguous float32 [rows, ", k, "] tensor, got ", x.sizes());
}

const float* residual_ptr(const c10::optional<at::Tensor>& residual, int64_t m, int64_t n) {
  if (!residual) return nullptr;
  check_rows(*residual, n, "residual");
  TORCH_CHECK(residual->size(0) == m, "residual has ", residual->size(0), " rows, not ", m);
  return residual->data_ptr<float>();
}

// a grain that gives every thread a similar share of column tiles, fixed in advance. (Taken
// as the threads come for them, the 1.5B's forwards on a Zen 5 after 256 positions did not
// gain: chunks of a shrinking share of what was left, 16 rows 1.01-1.05x the time, most
// likely as each chunk's last tile asks for no next tile's weights; each thread's half taken
// from its front, the other thread taking 6 tiles at a time from its back once done with its
// own, 1 row 1.00x, 16 rows 1.02x)
int64_t tile_grain(int64_t tiles) {
  int64_t threads = at::get_num_threads();
  return std::max<int64_t>(1, (tiles + threads - 1) / threads);
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& packed,
                        const c10::optional<at::Tensor>& scale,
                        const c10::optional<at::Tensor>& residual, int64_t n, int64_t isa) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 16 && packed.is_contiguous(),
              "dense weights must be packed [N / 16, K, 16]");
  const int64_t k = packed.size(1), m = x.size(0), tiles = packed.size(0);
  check_rows(x, k, "dense_linear input");
  TORCH_CHECK(tiles * 16 >= n, "packed weights hold ", tiles * 16, " columns, not ", n);
  const float* res = residual_ptr(residual, m, n);
  const float* sc = scale ? scale->data_ptr<float>() : nullptr;
  auto y = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, tiles, tile_grain(tiles), [&](int64_t t0, int64_t t1) {
    switch (packed.scalar_type()) {
      case at::kFloat:
        DISPATCH(isa, dense_columns<float>, xp, m, k, packed.data_ptr<float>(), sc, res, yp, n, t0, t1);
        break;
      case at::kBFloat16:
        DISPATCH(isa, dense_columns<uint16_t>, xp, m, k,
                 reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), sc, res, yp, n, t0, t1);
        break;
      case at::kChar:
        DISPATCH(isa, dense_columns<int8_t>, xp, m, k, packed.data_ptr<int8_t>(), sc, res, yp, n, t0, t1);
        break;
      default:
        TORCH_CHECK(false, "dense weights must be float32, bfloat16 or int8");
    }
  });
  return y;
}

// x ~ dx * xq per row and 32 inputs: dx = max|x| / 127, xq = round(x * 127 / max|x|)
// (G = 256 for the Q6_K layout, small_codes.h); sx (null: not wanted) = dx * sum(xq)
template <int G = 32>
void quantise_rows(const float* x, int64_t r0, int64_t r1, int64_t k, int8_t* xq, float* dx,
                   float* sx) {
  const int64_t groups = k / G;
  for (int64_t r = r0; r < r1; r++)
    for (int64_t g = 0; g < groups; g++) {
      const float* xg = x + r * k + g * G;
      float amax = 0.0f;
      for (int i = 0; i < G; i++) amax = std::max(amax, std::fabs(xg[i]));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int32_t total = 0;
      for (int i = 0; i < G; i++) {
        int32_t q = (int32_t)std::nearbyint(xg[i] * inv);
        q = std::min(127, std::max(-127, q));
        xq[r * k + g * G + i] = (int8_t)q;
        total += q;
      }
      dx[r * groups + g] = amax / 127.0f;
      if (sx) sx[r * groups + g] = dx[r * groups + g] * (float)total;
    }
}

// quantise_rows with the CPU's widest registers (the same bytes either way)
template <int G = 32>
void quantise_rows_isa(const float* x, int64_t r0, int64_t r1, int64_t k, int8_t* xq, float* dx,
                       float* sx, int64_t isa) {
  if (isa >= AVX512)
    k_avx512::quantise_rows_avx512<G>(x, r0, r1, k, xq, dx, sx);
  else if (isa == AVX2)
    k_avx2::quantise_rows_avx2<G>(x, r0, r1, k, xq, dx, sx);
  else
    quantise_rows<G>(x, r0, r1, k, xq, dx, sx);
}

// whether a kernel whose tiles pay from `min_rows` rows takes them for m rows: the isa level
// may be passed in by hand, so the tiles' permission is checked here as well
bool tiles_pay(int64_t m, int64_t isa, int64_t min_rows) {
  return isa >= AMX && m >= min_rows && k_amx::amx_usable();
}

// whether q4_linear takes the AMX tiles for m rows: from AMX_MIN_ROWS (fewer are bound by the
// weights' memory traffic, or by the tile operations' fixed cost, where VNNI is as fast)
bool q4_uses_amx(int64_t m, int64_t isa) { return tiles_pay(m, isa, AMX_MIN_ROWS); }

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed,
                     const c10::optional<at::Tensor>& residual, int64_t n, int64_t isa) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == Q4_BLOCK && packed.scalar_type() == at::kByte &&
              packed.is_contiguous(), "q4 weights must be packed uint8 [N / 16, K / 32, 320]");
  const int64_t tiles = packed.size(0), k = packed.size(1) * 32, m = x.size(0);
  check_rows(x, k, "q4_linear input");
  TORCH_CHECK(tiles * 16 >= n, "packed weights hold ", tiles * 16, " columns, not ", n);
  const float* res = residual_ptr(residual, m, n);
  const bool amx = q4_uses_amx(m, isa);
  // the tiles read whole blocks of 16 rows of activations (the padding is never folded)
  std::vector<int8_t> xq((amx ? (m + 15) / 16 * 16 : m) * k);
  std::vector<float> dx(m * (k / 32)), sx(m * (k / 32));
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, m, 8, [&](int64_t r0, int64_t r1) {  // rows: one quantisation each
    quantise_rows_isa(xp, r0, r1, k, xq.data(), dx.data(), sx.data(), isa);
  });
  auto y = at::empty({m, n}, x.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, tile_grain(tiles), [&](int64_t t0, int64_t t1) {
    if (amx)
      k_amx::q4_columns_amx(xq.data(), dx.data(), sx.data(), m, k, w, res, yp, n, t0, t1);
    else if (isa >= AVX512)
      k_avx512::q4_columns_vnni(xq.data(), dx.data(), sx.data(), m, k, w, res, yp, n, t0, t1);
    else if (isa == AVX2)
      k_avx2::q4_columns_avx2(xq.data(), dx.data(), sx.data(), m, k, w, res, yp, n, t0, t1);
    else
      k_generic::q4_columns_generic(xq.data(), dx.data(), sx.data(), m, k, w, res, yp, n, t0, t1);
  });
  return y;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t isa) {
  const int64_t h = weight.numel();
  check_rows(x, h, "rms_norm input");
  auto y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, x.size(0), ROW_GRAIN, [&](int64_t r0, int64_t r1) {
    DISPATCH(isa, rms_norm_rows, xp + r0 * h, wp, yp + r0 * h, r1 - r0, h, (float)eps);
  });
  return y;
}

// the gate activations of gated(): SwiGLU, GeGLU, gpt-oss's clamped SwiGLU
enum GateMode : int64_t { GATE_SILU = 0, GATE_GELU = 1, GATE_OSS = 2 };

// act(gate) * up for [rows, 2 I] (gate then up): SwiGLU (silu), GeGLU (gelu_tanh) or gpt-oss's
// (up + 1) * clamped swish
at::Tensor gated(const at::Tensor& gate_up, int64_t isa, int64_t mode) {
  TORCH_CHECK(mode == GATE_SILU || mode == GATE_GELU || mode == GATE_OSS, "unknown gate mode ", mode);
  const char* name = mode == GATE_GELU ? "geglu" : mode == GATE_OSS ? "oss_glu" : "swiglu";
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, name, " takes [rows, 2 I]");
  check_rows(gate_up, gate_up.size(1), name);
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto y = at::empty({rows, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t r0, int64_t r1) {
    if (mode == GATE_GELU)
      DISPATCH(isa, geglu_rows, gp + r0 * 2 * inter, yp + r0 * inter, r1 - r0, inter);
    else if (mode == GATE_OSS)
      DISPATCH(isa, oss_glu_rows, gp + r0 * 2 * inter, yp + r0 * inter, r1 - r0, inter);
    else
      DISPATCH(isa, swiglu_rows, gp + r0 * 2 * inter, yp + r0 * inter, r1 - r0, inter);
  });
  return y;
}

at::Tensor swiglu(const at::Tensor& gate_up, int64_t isa) { return gated(gate_up, isa, GATE_SILU); }

at::Tensor geglu(const at::Tensor& gate_up, int64_t isa) { return gated(gate_up, isa, GATE_GELU); }

at::Tensor oss_glu(const at::Tensor& gate_up, int64_t isa) { return gated(gate_up, isa, GATE_OSS); }

at::Tensor softcap(const at::Tensor& x, double cap, int64_t isa) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && cap > 0, "softcap takes contiguous float32 and a positive cap");
  auto y = at::empty_like(x);
  DISPATCH(isa, softcap_values, x.data_ptr<float>(), y.data_ptr<float>(), x.numel(), (float)cap);
  return y;
}

// A token from each row of logits [n, V] (the data writer's sampler): the first largest at
// temperature 0, else generic.h's nucleus_draw with the row's uniforms [n, tries] (-1: none
// kept; the caller draws again). One thread a row, each row's own operations: a row's token
// does not depend on the rows beside it, the thread count or the instruction set.
at::Tensor draw_tokens(const at::Tensor& logits, const at::Tensor& temperatures,
                       const at::Tensor& uniforms, double top_p, int64_t isa) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "draw_tokens: logits must be a contiguous float32 [rows, vocabulary] tensor");
  const int64_t n = logits.size(0), v = logits.size(1);
  TORCH_CHECK(v > 0, "draw_tokens: an empty vocabulary");
  TORCH_CHECK(temperatures.dim() == 1 && temperatures.size(0) == n &&
              temperatures.scalar_type() == at::kFloat && temperatures.is_contiguous(),
              "draw_tokens: temperatures must be float32 [rows]");
  TORCH_CHECK(uniforms.dim() == 2 && uniforms.size(0) == n && uniforms.scalar_type() == at::kFloat &&
              uniforms.is_contiguous(), "draw_tokens: uniforms must be float32 [rows, tries]");
  TORCH_CHECK(top_p > 0 && top_p <= 1, "draw_tokens: top_p must be in (0, 1]");
  const float* tp = temperatures.data_ptr<float>();
  for (int64_t r = 0; r < n; r++)
    TORCH_CHECK(tp[r] >= 0 && std::isfinite(tp[r]), "draw_tokens: a temperature below 0 or not finite");
  auto tokens = at::empty({n}, at::kLong);
  const float *xp = logits.data_ptr<float>(), *up = uniforms.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  const int64_t tries = uniforms.size(1);
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> e(v), sums(v / k_generic::DRAW_BLOCK + 1);
    for (int64_t r = r0; r < r1; r++) {
      const float* x = xp + r * v;
      if (tp[r] == 0.0f) {
        DISPATCH(isa, first_argmax_into, x, v, out + r);
        continue;
      }
      DISPATCH(isa, nucleus_draw_into, x, v, tp[r], up + r * tries, tries, (float)top_p,
               e.data(), sums.data(), out + r);
    }
  });
  return tokens;
}

// The `limit` most probable tokens of each row of a drafter's logits [n, V] and their
// probabilities (generic.h's top_probs): ([n, limit] float32, [n, limit] int64). Rows of a
// small call run on the calling thread (a parallel region costs more than their scan).
std::vector<at::Tensor> top_probs(const at::Tensor& logits, int64_t limit, int64_t isa) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "top_probs: logits must be a contiguous float32 [rows, vocabulary] tensor");
  const int64_t n = logits.size(0), v = logits.size(1);
  TORCH_CHECK(limit >= 1 && limit <= v, "top_probs: limit must be in 1 .. ", v, ", got ", limit);
  auto probs = at::empty({n, limit}, at::kFloat);
  auto ids = at::empty({n, limit}, at::kLong);
  const float* xp = logits.data_ptr<float>();
  float* pp = probs.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  at::parallel_for(0, n, std::max<int64_t>(1, (1 << 16) / v), [&](int64_t r0, int64_t r1) {
    std::vector<float> e(v);
    for (int64_t r = r0; r < r1; r++)
      DISPATCH(isa, top_probs, xp + r * v, v, limit, e.data(), ip + r * limit, pp + r * limit);
  });
  return {probs, ids};
}

static void check_caches(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t d) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
              v_cache.dim() == 3 && k_cache.size(1) * 16 == v_cache.size(1) &&
              k_cache.size(2) == d && v_cache.size(2) == d,
              "caches must be contiguous [KH, capacity / 16, D, 16] (keys) and [KH, capacity, D] (values)");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
              (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16),
              "the key and value caches must both be float32 or both bfloat16");
}

// One sequence's share of a forward: rows r0 .. r1 - 1 of the call and the layer's caches of
// its own (k, v: at its key/value head 0, `cap` slots a head). Its row r0 + i writes slot[i] and
// sees slots 0 .. past - 1, then keys[i * width .. i * width + lens[i] - 1].
template <typename KV>
struct Segment {
  KV* k;
  KV* v;
  int64_t cap, r0, r1, past;
  const int64_t* slot;
  const int32_t* keys;
  const int32_t* lens;
  int64_t width;
};

template <typename KV>
static KV* cache_data(const at::Tensor& cache) {
  if constexpr (std::is_same<KV, float>::value) return cache.data_ptr<float>();
  else return reinterpret_cast<uint16_t*>(cache.data_ptr<at::BFloat16>());
}

// the m rows of a slot table: each row writes a slot below `cap` and sees past + lens[r] <= cap
// positions, named by slots below `cap`
static void check_keys(const int64_t* slot, const int32_t* sp, const int32_t* lp, int64_t m,
                       int64_t width, int64_t past, int64_t cap) {
  TORCH_CHECK(past >= 0, "negative past");
  for (int64_t r = 0; r < m; r++) {
    TORCH_CHECK(slot[r] >= 0 && slot[r] < cap, "cache slot ", slot[r], " out of range");
    TORCH_CHECK(lp[r] >= 0 && lp[r] <= width && past + lp[r] <= cap, "bad slot count");
    for (int64_t i = 0; i < lp[r]; i++)
      TORCH_CHECK(sp[r * width + i] >= 0 && sp[r * width + i] < cap, "slot out of range");
  }
}

// Rotary embedding of every segment's rows; k and v go into the segment's own caches
template <typename KV>
static void rope_store_segments(const float* src, const float* cos, const float* sin, int64_t d,
                                int64_t heads, int64_t kv_heads, float* qp,
                                const std::vector<Segment<KV>>& segs, int64_t isa) {
  TORCH_CHECK(d <= k_generic::ROPE_MAX_D, "rotary embedding of heads of more than ",
              k_generic::ROPE_MAX_D, " values");
  const int64_t width = (heads + 2 * kv_heads) * d, rows = segs.empty() ? 0 : segs.back().r1;
  // the rows on the threads (each row writes its own slot); a share cuts segments where it ends
  at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t a, int64_t b) {
    for (const Segment<KV>& s : segs) {
      const int64_t r0 = std::max(a, s.r0), r1 = std::min(b, s.r1);
      if (r0 < r1)
        DISPATCH(isa, rope_store_rows<KV>, src + r0 * width, cos + r0 * d, sin + r0 * d, r1 - r0,
                 d, heads, kv_heads, s.cap, s.slot + (r0 - s.r0), qp + r0 * heads * d, s.k, s.v);
    }
  });
}

// Attention of every segment's rows on its own cache, in one parallel region: one work item is
// a block of rows of one segment (a block never mixes two caches) and a key/value head, with the
// query heads that share it. A row's result depends on its own keys alone (see
// attention.h), so how the rows of a call fall into segments and blocks changes no bit.
// ``softcap`` > 0: scores soft-capped to softcap * tanh(score / softcap) (Gemma 2); 0: none.
// ``sinks``: each query head's attention sink logit [heads] (gpt-oss; null: none).
template <typename KV>
static void attend_segments(const float* qp, float* op, const std::vector<Segment<KV>>& segs,
                            int64_t heads, int64_t d, int64_t kv, int64_t window,
                            double softcap, const float* sinks, int64_t isa) {
  const int64_t group = heads / kv;
  const bool blocked = isa >= AVX2 && blocks_fit(d);
  const bool wide = isa >= AVX512;
  const int64_t per_block = !blocked ? 1 : wide ? k_avx512::block_rows(group) : k_avx2::block_rows(group);
  std::vector<std::pair<int64_t, int64_t>> blocks;  // (segment, its first row)
  int64_t stride = 16;
  for (size_t s = 0; s < segs.size(); s++) {
    for (int64_t r = segs[s].r0; r < segs[s].r1; r += per_block) blocks.emplace_back(s, r);
    stride = std::max(stride, (segs[s].past + segs[s].width + 15) / 16 * 16);
  }
  // the work items dealt round the threads like cards: a chain's later rows see more keys, so
  // contiguous shares left the first thread idle (a 128-row prompt block after an empty cache
  // ran 1.35x faster on 2 threads than on 1; scripts/attention_costs.py)
  const int64_t items = (int64_t)blocks.size() * kv;
  const int64_t lanes = std::min<int64_t>(items, at::get_num_threads());
  at::parallel_for(0, lanes, 1, [&](int64_t l0, int64_t l1) {
    std::vector<float> scores(!blocked ? stride
                              : wide ? k_avx512::scores_floats(group, stride)
                                     : k_avx2::scores_floats(group, stride));
    std::vector<int32_t> window_slots(per_block * std::max<int64_t>(window, 0));
    for (int64_t lane = l0; lane < l1; lane++)  // (one lane a thread)
    for (int64_t i = lane; i < items; i += lanes) {
      const Segment<KV>& seg = segs[blocks[i / kv].first];
      const int64_t kvh = i % kv, past = seg.past, r0 = blocks[i / kv].second;
      const int64_t r1 = std::min(seg.r1, r0 + per_block);
      const KV *kt = seg.k + kvh * seg.cap * d, *vc = seg.v + kvh * seg.cap * d;
      const float* group_sinks = sinks ? sinks + kvh * group : nullptr;
      RowKeys rows[BLOCK_ROWS_MAX];
      for (int64_t r = r0; r < r1; r++) {
        const int64_t first = r * heads + kvh * group, len = past + seg.lens[r - seg.r0];
        const int32_t* own = seg.keys + (r - seg.r0) * seg.width;
        RowKeys& row = rows[r - r0];
        if (window > 0 && len > window) {
          // a sliding window: the row's last `window` positions, every one named by its slot
          // (none read as a cached block), so the row sees the same keys in the same order,
          // with the same lanes, in any call
          int32_t* named = window_slots.data() + (r - r0) * window;
          for (int64_t j = len - window; j < len; j++)
            named[j - (len - window)] = j < past ? (int32_t)j : own[j - past];
          row = {qp + first * d, op + first * d, named, 0, window};
        } else {
          int64_t cached = past;  // the row's own slots that follow the cache in order
          while (cached < len && own[cached - past] == cached) cached++;
          row = {qp + first * d, op + first * d, own + (cached - past), cached, len};
        }
        if (!blocked)
          DISPATCH(isa, attend_group, row.q, kt, vc, d, row.cached, row.slots, row.len,
                   scores.data(), row.out, group, (float)softcap, group_sinks);
      }
      if (blocked && wide)
        k_avx512::attend_rows(rows, r1 - r0, kt, vc, d, scores.data(), stride, group, (float)softcap,
                              group_sinks);
      else if (blocked)
        k_avx2::attend_rows(rows, r1 - r0, kt, vc, d, scores.data(), stride, group, (float)softcap,
                            group_sinks);
    }
  });
}

// Rotary embedding of the q and k heads of a fused qkv output [m, (H + 2 KH) D]; k is written
// into the layer's key cache [KH, capacity / 16, D, 16] (blocks of 16 slots), v into its value cache
// [KH, capacity, D], at ``slots``; returns q [m, H, D]. Caches float32 or bfloat16 (rounded to
// nearest even).
// cos, sin [m, D] with rotate_half's sign folded into sin: out = x * cos + swap(x) * sin.
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      int64_t heads, int64_t kv_heads, at::Tensor k_cache, at::Tensor v_cache,
                      const at::Tensor& slots, int64_t isa) {
  const int64_t m = qkv.size(0), d = cos.size(1), cap = v_cache.size(1);
  check_rows(qkv, (heads + 2 * kv_heads) * d, "rope_store input");
  check_rows(cos, d, "rope cos");
  check_rows(sin, d, "rope sin");
  check_caches(k_cache, v_cache, d);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == m, "one int64 slot a row");
  auto q = at::empty({m, heads, d}, qkv.options());
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < m; r++)
    TORCH_CHECK(slot[r] >= 0 && slot[r] < cap, "cache slot ", slot[r], " out of range");
  if (k_cache.scalar_type() == at::kFloat)
    rope_store_segments<float>(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                               d, heads, kv_heads, q.data_ptr<float>(),
                               {{cache_data<float>(k_cache), cache_data<float>(v_cache), cap, 0, m, 0, slot}},
                               isa);
  else
    rope_store_segments<uint16_t>(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                                  d, heads, kv_heads, q.data_ptr<float>(),
                                  {{cache_data<uint16_t>(k_cache), cache_data<uint16_t>(v_cache), cap, 0, m, 0, slot}},
                                  isa);
  return q;
}

// a layer's attention sinks [heads] float32 as attend_segments takes them (null: none)
static const float* sink_logits(const c10::optional<at::Tensor>& sinks, int64_t heads) {
  if (!sinks.has_value()) return nullptr;
  TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == heads,
              "attention sinks must be float32 [", heads, "] (one a query head)");
  return sinks->data_ptr<float>();
}

// q [m, H, D]; caches [KH, capacity / 16, D, 16] (keys), [KH, capacity, D] (values), float32
// or bfloat16; row r sees positions 0..past-1 (slots 0..past-1) and then slots[r, :lens[r]];
// with a sliding ``window`` > 0 only its last ``window`` positions; ``softcap`` > 0 soft-caps
// the scores (0: none); ``sinks`` [H] float32: each head's attention sink (gpt-oss; none: no
// sinks). Returns [m, H * D]. The one-segment case of attend_segments.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     int64_t past, const at::Tensor& slots, const at::Tensor& lens, int64_t window,
                     double softcap, int64_t isa, const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kFloat, "q must be [m, H, D]");
  const int64_t m = q.size(0), heads = q.size(1), d = q.size(2), kv = k_cache.size(0);
  const float* sk = sink_logits(sinks, heads);
  const int64_t cap = v_cache.size(1), width = slots.size(1);
  check_caches(k_cache, v_cache, d);
  TORCH_CHECK(heads % kv == 0, "q's heads are not a multiple of the cache's key/value heads");
  TORCH_CHECK(slots.scalar_type() == at::kInt && lens.scalar_type() == at::kInt &&
              slots.is_contiguous() && slots.size(0) == m && lens.numel() == m, "bad slot table");
  const int32_t* sp = slots.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const std::vector<int64_t> writes(m, 0);  // attention writes nothing: slot 0 passes the check
  check_keys(writes.data(), sp, lp, m, width, past, cap);
  auto out = at::empty({m, heads * d}, q.options());
  if (k_cache.scalar_type() == at::kFloat)
    attend_segments<float>(q.data_ptr<float>(), out.data_ptr<float>(),
                           {{cache_data<float>(k_cache), cache_data<float>(v_cache), cap, 0, m, past,
                             nullptr, sp, lp, width}}, heads, d, kv, window, softcap, sk, isa);
  else
    attend_segments<uint16_t>(q.data_ptr<float>(), out.data_ptr<float>(),
                              {{cache_data<uint16_t>(k_cache), cache_data<uint16_t>(v_cache), cap, 0, m,
                                past, nullptr, sp, lp, width}}, heads, d, kv, window, softcap, sk, isa);
  return out;
}

// Where the rows of one packed forward go, checked once and read by every layer: sequence s
// has a cache of its own (every layer's: keys [L, KH, capacity / 16, D, 16], values
// [L, KH, capacity, D]; all caches of one type and shape but for their capacities, which grow
// with each sequence) and the next slots[s].numel() rows
// of the call; its i-th row writes its key and value at slots[s][i] of that cache and sees
// slots 0 .. pasts[s] - 1, then keys[s][i, :lens[s][i]] (slots in position order, itself last).
struct PackedPlan {
  std::vector<at::Tensor> k_caches, v_caches;
  std::vector<int64_t> pasts;
  std::vector<at::Tensor> slots, keys, lens;
  std::vector<int64_t> caps;
  int64_t rows = 0, layers, kv, d;
  bool bf16;

  PackedPlan(std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
             std::vector<int64_t> pasts, std::vector<at::Tensor> slots,
             std::vector<at::Tensor> keys, std::vector<at::Tensor> lens)
      : k_caches(std::move(k_caches)), v_caches(std::move(v_caches)), pasts(std::move(pasts)),
        slots(std::move(slots)), keys(std::move(keys)), lens(std::move(lens)) {
    const size_t n = this->pasts.size();
    TORCH_CHECK(n > 0 && this->k_caches.size() == n && this->v_caches.size() == n &&
                this->slots.size() == n && this->keys.size() == n && this->lens.size() == n,
                "a packed plan needs, per sequence, its caches, past, slots, keys and lens");
    const at::Tensor &k0 = this->k_caches[0], &v0 = this->v_caches[0];
    TORCH_CHECK(k0.dim() == 5 && v0.dim() == 4, "caches must be [L, KH, capacity / 16, D, 16] and [L, KH, capacity, D]");
    layers = k0.size(0), kv = k0.size(1), d = v0.size(3);
    bf16 = k0.scalar_type() == at::kBFloat16;
    for (size_t s = 0; s < n; s++) {
      const at::Tensor &k = this->k_caches[s], &v = this->v_caches[s];
      TORCH_CHECK(k.dim() == 5 && v.dim() == 4 && k.size(0) == layers && v.size(0) == layers &&
                  k.size(1) == kv && v.size(1) == kv && v.size(3) == d &&
                  k.scalar_type() == k0.scalar_type() && v.scalar_type() == k0.scalar_type(),
                  "every sequence's cache must have the layers, heads, head size and type of the first");
      check_caches(k.select(0, 0), v.select(0, 0), d);
      const int64_t cap = v.size(2);
      caps.push_back(cap);
      const at::Tensor &slot = this->slots[s], &key = this->keys[s], &len = this->lens[s];
      const int64_t m = slot.numel();
      TORCH_CHECK(m > 0 && slot.scalar_type() == at::kLong && slot.is_contiguous(),
                  "a sequence's slots: one int64 a row, at least one row");
      TORCH_CHECK(key.scalar_type() == at::kInt && len.scalar_type() == at::kInt &&
                  key.dim() == 2 && key.is_contiguous() && key.size(0) == m &&
                  len.is_contiguous() && len.numel() == m, "bad slot table");
      check_keys(slot.data_ptr<int64_t>(), key.data_ptr<int32_t>(), len.data_ptr<int32_t>(), m,
                 key.size(1), this->pasts[s], cap);
      rows += m;
    }
  }

  // every sequence's rows and its caches of layer `layer`
  template <typename KV>
  std::vector<Segment<KV>> segments(int64_t layer) const {
    TORCH_CHECK(0 <= layer && layer < layers, "layer ", layer, " is outside the caches");
    std::vector<Segment<KV>> segs;
    segs.reserve(pasts.size());
    int64_t r0 = 0;
    for (size_t s = 0; s < pasts.size(); s++) {
      const int64_t r1 = r0 + slots[s].numel(), per_layer = kv * caps[s] * d;
      segs.push_back({cache_data<KV>(k_caches[s]) + layer * per_layer,
                      cache_data<KV>(v_caches[s]) + layer * per_layer, caps[s], r0, r1, pasts[s],
                      slots[s].data_ptr<int64_t>(), keys[s].data_ptr<int32_t>(),
                      lens[s].data_ptr<int32_t>(), keys[s].size(1)});
      r0 = r1;
    }
    return segs;
  }

  // rope_store of every sequence's rows into its own cache of layer `layer`; q [rows, H, D]
  at::Tensor rope_store(int64_t layer, const at::Tensor& qkv, const at::Tensor& cos,
                        const at::Tensor& sin, int64_t heads, int64_t kv_heads, int64_t isa) const {
    TORCH_CHECK(kv_heads == kv && qkv.size(0) == rows && cos.size(0) == rows && sin.size(0) == rows,
                "rope_store: the plan's rows and key/value heads");
    check_rows(qkv, (heads + 2 * kv_heads) * d, "rope_store input");
    check_rows(cos, d, "rope cos");
    check_rows(sin, d, "rope sin");
    auto q = at::empty({rows, heads, d}, qkv.options());
    if (bf16)
      rope_store_segments<uint16_t>(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                                    d, heads, kv, q.data_ptr<float>(), segments<uint16_t>(layer), isa);
    else
      rope_store_segments<float>(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                                 d, heads, kv, q.data_ptr<float>(), segments<float>(layer), isa);
    return q;
  }

  // attention of every sequence's rows on its own cache of layer `layer`; [rows, H * D];
  // sinks: the layer's attention sinks [H] (gpt-oss; none: no sinks)
  at::Tensor attention(int64_t layer, const at::Tensor& q, int64_t window, double softcap,
                       int64_t isa, const c10::optional<at::Tensor>& sinks = c10::nullopt) const {
    TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kFloat &&
                q.size(0) == rows && q.size(2) == d && q.size(1) % kv == 0,
                "q must be [rows, H, D], H a multiple of the caches' key/value heads");
    const int64_t heads = q.size(1);
    const float* sk = sink_logits(sinks, heads);
    auto out = at::empty({rows, heads * d}, q.options());
    if (bf16)
      attend_segments<uint16_t>(q.data_ptr<float>(), out.data_ptr<float>(), segments<uint16_t>(layer),
                                heads, d, kv, window, softcap, sk, isa);
    else
      attend_segments<float>(q.data_ptr<float>(), out.data_ptr<float>(), segments<float>(layer),
                             heads, d, kv, window, softcap, sk, isa);
    return out;
  }
};

// One linear layer as the kernels hold it, whatever its format: int4 (Q4_1 tiles, q4_linear),
// block int8 (q8_blocks.h, q8_linear), the file's own 5 or 6-bit codes (small_codes.h,
// small_codes_linear; `group` holds its layout code) or dense fp32/bf16 tiles (dense_linear). A stack of
// layers calls it with the arguments the Python layer objects (models/quant.py) pass the same
// kernel, so the stack computes the same bits. A SPLIT layer is matrices sharing an input held
// in formats of their own (a Q4_K_M file's Q4_K q/k beside its Q6_K v): its parts' outputs side
// by side, as models/quant.py's SplitLinear computes them.
struct PackedLinear {
  enum Kind : int64_t { INT4 = 0, BLOCK_INT8 = 1, DENSE = 2, SMALL_CODES = 3, SPLIT = 4 };
  at::Tensor packed;
  int64_t kind, n, group;
  bool minimum, half;
  double input_scale;  // SMALL_CODES: small_codes_linear's (a query scale folded in)
  c10::optional<at::Tensor> codebook;  // SMALL_CODES: small_codes_linear's (codebook layouts)
  int64_t scaled_columns;  // SMALL_CODES: small_codes_linear's (the columns input_scale is of)
  std::vector<PackedLinear> parts;

  PackedLinear(at::Tensor packed, int64_t kind, int64_t n, int64_t group, bool minimum, bool half,
               double input_scale, c10::optional<at::Tensor> codebook, int64_t scaled_columns)
      : packed(std::move(packed)), kind(kind), n(n), group(group), minimum(minimum), half(half),
        input_scale(input_scale), codebook(std::move(codebook)), scaled_columns(scaled_columns) {
    TORCH_CHECK(kind == INT4 || kind == BLOCK_INT8 || kind == DENSE || kind == SMALL_CODES,
                "unknown linear kind ", kind);
    TORCH_CHECK(input_scale == 1.0 || kind == SMALL_CODES, "only small-code layers take an input scale");
    TORCH_CHECK(!this->codebook || kind == SMALL_CODES, "only small-code layers take a codebook");
  }

  explicit PackedLinear(std::vector<PackedLinear> parts)
      : kind(SPLIT), n(0), group(0), minimum(false), half(false), input_scale(1.0),
        scaled_columns(-1), parts(std::move(parts)) {
    TORCH_CHECK(this->parts.size() >= 2, "a split linear layer needs two parts or more");
    for (const PackedLinear& part : this->parts) n += part.n;
  }

  at::Tensor operator()(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                        int64_t isa) const {
    if (kind == SPLIT) {
      std::vector<at::Tensor> outputs;
      for (const PackedLinear& part : parts) outputs.push_back(part(x, c10::nullopt, isa));
      at::Tensor y = at::cat(outputs, 1);
      return residual ? y.add_(*residual) : y;
    }
    if (kind == INT4) return q4_linear(x, packed, residual, n, isa);
    if (kind == BLOCK_INT8) return q8_linear(x, packed, group, minimum, half, residual, n, isa);
    if (kind == SMALL_CODES)
      return small_codes_linear(x, packed, group, minimum, residual, n, isa, input_scale, codebook,
                                scaled_columns);
    return dense_linear(x, packed, c10::nullopt, residual, n, isa);
  }
};

// The decoder layers of a plain Llama forward (RMSNorm, fused QKV and, for Qwen2, its bias,
// rotary embedding with the cache write, attention, o + residual, RMSNorm, fused gate/up,
// SwiGLU, down + residual),
// layers first .. last - 1 in one call: the kernels the runner's Python loop calls, in the same
// order on the same tensors (so the same bits), without ten Python calls and their dispatch a
// layer. Weights are held once, each linear layer in its own format; the rows of one or many
// sequences come with each call (a PackedPlan): the linear layers run over all of them at once,
// rotary embedding and attention per sequence on its own cache. A draft network's decoder layer
// (heads/native_blocks.py) is a stack of one or two layers.
struct LayerStack {
  std::vector<at::Tensor> attn_norm, mlp_norm, qkv_bias;
  std::vector<PackedLinear> qkv, o, gate_up, down;
  std::vector<int64_t> window;
  int64_t heads, kv_heads, hidden;
  double eps;

  // qkv_bias: each layer's [(H + 2 KH) D] bias of the fused q/k/v, or empty for none
  LayerStack(std::vector<at::Tensor> attn_norm, std::vector<PackedLinear> qkv,
             std::vector<PackedLinear> o, std::vector<at::Tensor> mlp_norm,
             std::vector<PackedLinear> gate_up, std::vector<PackedLinear> down,
             std::vector<int64_t> window, int64_t heads, int64_t kv_heads, int64_t head_dim,
             int64_t hidden, double eps, std::vector<at::Tensor> qkv_bias)
      : attn_norm(std::move(attn_norm)), mlp_norm(std::move(mlp_norm)),
        qkv_bias(std::move(qkv_bias)), qkv(std::move(qkv)), o(std::move(o)),
        gate_up(std::move(gate_up)), down(std::move(down)), window(std::move(window)),
        heads(heads), kv_heads(kv_heads), hidden(hidden), eps(eps) {
    const size_t layers = this->attn_norm.size();
    TORCH_CHECK(this->qkv.size() == layers && this->o.size() == layers &&
                this->mlp_norm.size() == layers && this->gate_up.size() == layers &&
                this->down.size() == layers && this->window.size() == layers &&
                (this->qkv_bias.empty() || this->qkv_bias.size() == layers),
                "every per-layer list must have one entry a layer");
    for (const at::Tensor& bias : this->qkv_bias)
      TORCH_CHECK(bias.dim() == 1 && bias.size(0) == (heads + 2 * kv_heads) * head_dim &&
                  bias.scalar_type() == at::kFloat, "a q/k/v bias must be float32 [(H + 2 KH) D]");
    for (size_t i = 0; i < layers; i++)
      TORCH_CHECK(this->qkv[i].n == (heads + 2 * kv_heads) * head_dim && this->o[i].n == hidden &&
                  this->down[i].n == hidden && this->gate_up[i].n % 2 == 0,
                  "layer ", i, "'s linear layers do not fit the stack's shape");
  }

  at::Tensor forward(at::Tensor x, int64_t first, int64_t last, const PackedPlan& plan,
                     const at::Tensor& cos, const at::Tensor& sin, int64_t isa) const {
    TORCH_CHECK(0 <= first && first <= last && last <= (int64_t)attn_norm.size() &&
                plan.layers >= last, "bad layer range");
    for (int64_t i = first; i < last; i++) {
      at::Tensor mixed = qkv[i](rms_norm(x, attn_norm[i], eps, isa), c10::nullopt, isa);
      if (!qkv_bias.empty()) mixed.add_(qkv_bias[i]);  // the Python loop's addition, in place
      const at::Tensor q = plan.rope_store(i, mixed, cos, sin, heads, kv_heads, isa);
      x = o[i](plan.attention(i, q, window[i], 0.0, isa), x, isa);  // no soft-capping
      const at::Tensor up = gate_up[i](rms_norm(x, mlp_norm[i], eps, isa), c10::nullopt, isa);
      x = down[i](swiglu(up, isa), x, isa);
    }
    return x;
  }
};

// A mixture-of-experts layer's experts (models/moe.py) in one call: each expert's gate/up, the
// gate's activation and its down layer over the rows that picked it, each pick's output times
// its weight, then each row's picks added in the order given (the caller sorts them by expert).
// Every step is a kernel or elementwise on one row, so a row's result does not depend on the
// rows beside it; one call instead of a dozen torch operations an expert. ``mode``: gated()'s
// activation; biases (gpt-oss): per expert its gate/up [2 I] and down [H] bias, added to the
// layer's output before the activation and before the weighting (empty lists: none).
struct MoEExperts {
  std::vector<PackedLinear> gate_up, down;
  int64_t mode;
  std::vector<at::Tensor> gate_up_bias, down_bias;

  MoEExperts(std::vector<PackedLinear> gate_up, std::vector<PackedLinear> down, int64_t mode,
             std::vector<at::Tensor> gate_up_bias, std::vector<at::Tensor> down_bias)
      : gate_up(std::move(gate_up)), down(std::move(down)), mode(mode),
        gate_up_bias(std::move(gate_up_bias)), down_bias(std::move(down_bias)) {
    const size_t experts = this->gate_up.size();
    TORCH_CHECK(this->down.size() == experts && experts > 0,
                "every expert needs a gate/up and a down layer");
    TORCH_CHECK(this->gate_up_bias.size() == this->down_bias.size() &&
                (this->gate_up_bias.empty() || this->gate_up_bias.size() == experts),
                "expert biases: a gate/up and a down bias for every expert, or none");
    for (size_t e = 0; e < this->gate_up_bias.size(); e++)
      TORCH_CHECK(this->gate_up_bias[e].scalar_type() == at::kFloat &&
                  this->gate_up_bias[e].numel() == this->gate_up[e].n &&
                  this->down_bias[e].scalar_type() == at::kFloat &&
                  this->down_bias[e].numel() == this->down[e].n,
                  "expert ", e, "'s biases must be float32 of its layers' output sizes");
  }

  // h [n, H] float32; picks [n, k] int64 expert indices; weights [n, k] float32
  at::Tensor forward(const at::Tensor& h, const at::Tensor& picks, const at::Tensor& weights,
                     int64_t isa) const {
    check_rows(h, h.size(1), "moe");
    TORCH_CHECK(picks.scalar_type() == at::kLong && weights.scalar_type() == at::kFloat &&
                picks.dim() == 2 && picks.sizes() == weights.sizes() && picks.size(0) == h.size(0),
                "moe takes picks [n, k] int64 and weights [n, k] float32 for h's n rows");
    const int64_t n = h.size(0), k = picks.size(1), hidden = h.size(1);
    const int64_t experts = (int64_t)gate_up.size();
    const auto pc = picks.contiguous();
    const auto wc = weights.contiguous();
    const int64_t* pp = pc.data_ptr<int64_t>();
    const float* wp = wc.data_ptr<float>();
    std::vector<std::vector<int64_t>> taken(experts);  // each expert's picks, row order
    for (int64_t i = 0; i < n * k; i++) {
      TORCH_CHECK(0 <= pp[i] && pp[i] < experts, "moe: expert ", pp[i], " of ", experts);
      taken[pp[i]].push_back(i);
    }
    auto terms = at::empty({n * k, hidden}, h.options());
    float* tp = terms.data_ptr<float>();
    for (int64_t e = 0; e < experts; e++) {
      if (taken[e].empty()) continue;
      const int64_t m = (int64_t)taken[e].size();
      auto rows = at::empty({m}, pc.options());
      int64_t* rp = rows.data_ptr<int64_t>();
      for (int64_t j = 0; j < m; j++) rp[j] = taken[e][j] / k;
      const bool biased = !gate_up_bias.empty();
      at::Tensor mixed = gate_up[e](h.index_select(0, rows), c10::nullopt, isa);
      if (biased) mixed = mixed + gate_up_bias[e];
      at::Tensor y = down[e](gated(mixed, isa, mode), c10::nullopt, isa);
      if (biased) y = y + down_bias[e];
      const float* yp = y.data_ptr<float>();
      for (int64_t j = 0; j < m; j++) {
        const int64_t pick = taken[e][j];
        const float w = wp[pick];
        float* dst = tp + pick * hidden;
        const float* src = yp + j * hidden;
        for (int64_t c = 0; c < hidden; c++) dst[c] = src[c] * w;
      }
    }
    auto out = at::empty({n, hidden}, h.options());
    float* op = out.data_ptr<float>();
    for (int64_t r = 0; r < n; r++) {
      float* dst = op + r * hidden;
      std::copy(tp + r * k * hidden, tp + (r * k + 1) * hidden, dst);
      for (int64_t s = 1; s < k; s++) {
        const float* src = tp + (r * k + s) * hidden;
        for (int64_t c = 0; c < hidden; c++) dst[c] = dst[c] + src[c];
      }
    }
    return out;
  }
};

// Hydra's heads (heads/networks.py HydraHeads, heads/native_hydra.py) in one call a draft step:
// head d reads the committed feature and the embeddings of a node's path (the root's next token
// first, d + 1 tokens), x = fuse_d(feature, embeddings), out = x + silu(res_d(x) + bias_d). The
// same kernels and ATen operations as the module converted by heads/native.py, on the same
// tensors, so the same bits; one call instead of a dozen torch operations, each of which costs
// several microseconds after a target forward has flushed the caches.
struct HydraHeads {
  std::vector<PackedLinear> fuse, res;
  std::vector<c10::optional<at::Tensor>> fuse_bias, res_bias;  // [H] float32, or none
  at::Tensor embed;  // the target's input embeddings [V, H]
  int64_t hidden;

  HydraHeads(std::vector<PackedLinear> fuse, std::vector<c10::optional<at::Tensor>> fuse_bias,
             std::vector<PackedLinear> res, std::vector<c10::optional<at::Tensor>> res_bias,
             at::Tensor embed)
      : fuse(std::move(fuse)), res(std::move(res)), fuse_bias(std::move(fuse_bias)),
        res_bias(std::move(res_bias)), embed(std::move(embed)), hidden(this->embed.size(1)) {
    const size_t heads = this->fuse.size();
    TORCH_CHECK(heads > 0 && this->res.size() == heads && this->fuse_bias.size() == heads &&
                this->res_bias.size() == heads, "HydraHeads: one fuse, res and bias per head");
    TORCH_CHECK(this->embed.dim() == 2, "HydraHeads: embeddings must be [vocabulary, hidden]");
  }

  // out [len(paths), H]: row j from head len(paths[j]) - 1 on `feature` [H] and paths[j]'s
  // embeddings; rows of one depth go through their head together
  at::Tensor forward(const at::Tensor& feature, const std::vector<std::vector<int64_t>>& paths,
                     int64_t isa) const {
    TORCH_CHECK(feature.dim() == 1 && feature.size(0) == hidden && feature.scalar_type() == at::kFloat,
                "HydraHeads: the feature must be float32 [", hidden, "]");
    const int64_t k = paths.size();
    std::map<size_t, std::vector<int64_t>> depths;  // path length -> rows, in row order
    for (int64_t j = 0; j < k; j++) {
      const size_t len = paths[j].size();
      TORCH_CHECK(len >= 1 && len <= fuse.size(), "HydraHeads: a path of ", len,
                  " tokens; the heads read 1 to ", fuse.size());
      for (int64_t token : paths[j])
        TORCH_CHECK(token >= 0 && token < embed.size(0), "HydraHeads: token ", token,
                    " is outside the vocabulary");
      depths[len].push_back(j);
    }
    at::Tensor out;
    for (const auto& [len, rows] : depths) {
      const int64_t g = rows.size(), d = len - 1;
      std::vector<int64_t> tokens;
      for (int64_t j : rows) tokens.insert(tokens.end(), paths[j].begin(), paths[j].end());
      const at::Tensor embeds = embed.index_select(0, at::tensor(tokens, at::kLong)).to(at::kFloat);
      const at::Tensor x = at::cat({feature.expand({g, hidden}), embeds.view({g, (int64_t)len * hidden})}, 1);
      const at::Tensor fused = fuse[d](x, bias_rows(fuse_bias[d], g), isa);
      const at::Tensor y = fused + at::silu(res[d](fused, bias_rows(res_bias[d], g), isa));
      if (g == k) return y;  // one depth: every row, in order
      if (!out.defined()) out = at::empty({k, hidden}, at::kFloat);
      out.index_copy_(0, at::tensor(rows, at::kLong), y);
    }
    return out;
  }

 private:
  static c10::optional<at::Tensor> bias_rows(const c10::optional<at::Tensor>& bias, int64_t g) {
    if (!bias) return c10::nullopt;
    return bias->expand({g, bias->size(0)}).contiguous();
  }
};

// Each `hidden`-wide part of `features` [n, parts x hidden] normed on its own (unit weights),
// times the parts' norm weights side by side: EAGLE-3's and DEER's per-layer norms.
static at::Tensor part_norms(const at::Tensor& features, const at::Tensor& unit,
                             const at::Tensor& weight, double eps, int64_t isa) {
  const at::Tensor each = rms_norm(features.reshape({-1, unit.size(0)}).contiguous(), unit, eps, isa);
  return each.view({features.size(0), -1}) * weight;
}

// EAGLE's head (heads/networks.py EagleHead; heads/native_blocks.py NativeEagleHead) a call at
// a time: the maps around its decoder layer with the layer itself (a LayerStack of one), the
// same kernels and ATen operations the Python class called one by one. A call's input rows are
// either committed positions (ingest: the target's features, with EAGLE-3's layers each normed
// on its own and fused by `fc`) or tree nodes (expand: their parents' states); where the head
// reads layers, `hidden_norm` norms either, then each row's token embedding is joined to it and
// `fuse` maps the pair to the layer's input. Returns the layer's output [n, H] (the rows'
// states) and its last row (ingest) or every row (expand) normed by `out_norm` as the
// shortlist scores it (no norms where the head reads the final features, EAGLE-1).
struct EagleHead {
  LayerStack stack;
  PackedLinear fuse;
  c10::optional<PackedLinear> fc;
  at::Tensor part_weight, hidden_weight, out_weight, unit, embed;
  double eps;

  EagleHead(LayerStack stack, PackedLinear fuse, c10::optional<PackedLinear> fc,
            at::Tensor part_weight, at::Tensor hidden_weight, at::Tensor out_weight,
            at::Tensor embed, double eps)
      : stack(std::move(stack)), fuse(std::move(fuse)), fc(std::move(fc)),
        part_weight(std::move(part_weight)), hidden_weight(std::move(hidden_weight)),
        out_weight(std::move(out_weight)), embed(std::move(embed)), eps(eps) {
    unit = at::ones({this->embed.size(1)}, at::kFloat);
  }

  // The committed positions' rows, a chain after the `past` slots of the head's cache
  // (k_cache, v_cache: [layers, ...] as PackedPlan takes them); `cos_table`, `sin_table`: the
  // rotary rows of every slot of the cache.
  std::vector<at::Tensor> ingest(const at::Tensor& features, const at::Tensor& tokens,
                                 const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 int64_t past, const at::Tensor& cos_table,
                                 const at::Tensor& sin_table, int64_t isa) const {
    const int64_t n = features.size(0);
    const at::Tensor states =
        fc ? (*fc)(part_norms(features, unit, part_weight, eps, isa), c10::nullopt, isa) : features;
    // AttentionPlan.chain: row i at slot and position past + i, seeing the slots past .. past + i
    const at::Tensor slots = at::arange(past, past + n, at::kLong);
    const PackedPlan plan({k_cache}, {v_cache}, {past}, {slots},
                          {slots.to(at::kInt).expand({n, n}).contiguous()},
                          {at::arange(1, n + 1, at::kInt)});
    const at::Tensor out = layer(states, tokens, plan, cos_table.index_select(0, slots),
                                 sin_table.index_select(0, slots), isa);
    return {out, scored(out.slice(0, n - 1), isa)};
  }

  // Tree rows after the `start` rows this step wrote after the `cached` committed slots:
  // row j at slot cached + start + j, seeing the committed slots, the tree rows
  // ancestors[j] (root to parent, each below start + j) and itself (AttentionPlan.tree_rows).
  std::vector<at::Tensor> expand(const std::vector<at::Tensor>& parent_states,
                                 const at::Tensor& tokens,
                                 const std::vector<std::vector<int64_t>>& ancestors,
                                 const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 int64_t cached, int64_t start, const at::Tensor& cos_table,
                                 const at::Tensor& sin_table, int64_t isa) const {
    const int64_t n = ancestors.size();
    size_t width = 0;
    for (const auto& path : ancestors) width = std::max(width, path.size() + 1);
    const at::Tensor slots = at::arange(cached + start, cached + start + n, at::kLong);
    at::Tensor keys = at::zeros({n, (int64_t)width}, at::kInt), lens = at::empty({n}, at::kInt);
    at::Tensor positions = at::empty({n}, at::kLong);
    for (int64_t j = 0; j < n; j++) {
      const auto& path = ancestors[j];
      int32_t* row = keys.data_ptr<int32_t>() + j * width;
      for (size_t a = 0; a < path.size(); a++) {
        TORCH_CHECK(0 <= path[a] && path[a] < start + j, "tree row ", start + j,
                    "'s ancestors must be earlier rows, got row ", path[a]);
        row[a] = cached + path[a];
      }
      row[path.size()] = cached + start + j;
      lens.data_ptr<int32_t>()[j] = path.size() + 1;
      positions.data_ptr<int64_t>()[j] = cached + path.size();
    }
    const PackedPlan plan({k_cache}, {v_cache}, {cached}, {slots}, {keys}, {lens});
    const at::Tensor out = layer(at::stack(parent_states), tokens, plan,
                                 cos_table.index_select(0, positions),
                                 sin_table.index_select(0, positions), isa);
    return {out, scored(out, isa)};
  }

 private:
  // the rows' states (normed by hidden_norm where the head reads layers) and tokens through
  // fuse and the decoder layer
  at::Tensor layer(at::Tensor states, const at::Tensor& tokens, const PackedPlan& plan,
                   const at::Tensor& cos, const at::Tensor& sin, int64_t isa) const {
    if (fc) states = rms_norm(states.contiguous(), hidden_weight, eps, isa);
    const at::Tensor joined = at::cat({states, embed.index_select(0, tokens).to(at::kFloat)}, -1);
    return stack.forward(fuse(joined, c10::nullopt, isa), 0, (int64_t)stack.attn_norm.size(), plan,
                         cos, sin, isa);
  }

  at::Tensor scored(const at::Tensor& out, int64_t isa) const {
    return fc ? rms_norm(out.contiguous(), out_weight, eps, isa) : out;
  }
};

// DEER's block drafter (heads/networks.py DeerDrafter; heads/native_blocks.py
// NativeDeerDrafter) a call a step, as EagleHead: the committed positions' features, each part
// normed on its own, fused and normed (the context's memory); each layer's keys and values of
// that memory written into the drafter's cache with their rotary embedding (DFlash's
// conditioning); then the block (the root's embedding and `block` mask rows, one mask for all or
// one a row, plus the anchor's own memory row where the drafter has `anchor_in` and the root's
// embedding where it has `root_in`, each through its map) through the layers, every row seeing the
// context and the whole block; returns the block's rows after the root, normed by `out_norm`.
struct DeerDrafter {
  LayerStack stack;
  PackedLinear fuse;
  std::vector<PackedLinear> context_kv;
  c10::optional<PackedLinear> anchor_in, root_in;
  at::Tensor part_weight, context_weight, out_weight, mask, unit, embed;
  int64_t hidden, heads, block;
  double eps;

  DeerDrafter(LayerStack stack, PackedLinear fuse, std::vector<PackedLinear> context_kv,
              c10::optional<PackedLinear> anchor_in, c10::optional<PackedLinear> root_in,
              at::Tensor part_weight, at::Tensor context_weight, at::Tensor out_weight,
              at::Tensor mask, at::Tensor embed, int64_t heads, int64_t block, double eps)
      : stack(std::move(stack)), fuse(std::move(fuse)), context_kv(std::move(context_kv)),
        anchor_in(std::move(anchor_in)), root_in(std::move(root_in)),
        part_weight(std::move(part_weight)),
        context_weight(std::move(context_weight)), out_weight(std::move(out_weight)),
        mask(std::move(mask)), embed(std::move(embed)), heads(heads), block(block), eps(eps) {
    hidden = this->embed.size(1);
    unit = at::ones({hidden}, at::kFloat);
    TORCH_CHECK(this->context_kv.size() == this->stack.attn_norm.size(),
                "DeerDrafter: one context k/v map a layer");
  }

  // `features` [n, parts x H] of the positions after the cache's `past` slots, whose rotary
  // rows are `positions`' in the tables; `root`: the token after the last of them
  at::Tensor ingest(const at::Tensor& features, int64_t root, const at::Tensor& positions,
                    const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t past,
                    const at::Tensor& cos_table, const at::Tensor& sin_table, int64_t isa) const {
    const int64_t n = features.size(0), layers = stack.attn_norm.size();
    const at::Tensor memory = rms_norm(fuse(part_norms(features, unit, part_weight, eps, isa),
                                            c10::nullopt, isa), context_weight, eps, isa);
    const at::Tensor cos = cos_table.index_select(0, positions), sin = sin_table.index_select(0, positions);
    const at::Tensor slots = at::arange(past, past + n, at::kLong);
    const at::Tensor no_queries = at::zeros({n, hidden}, at::kFloat);
    for (int64_t layer = 0; layer < layers; layer++)
      rope_store(at::cat({no_queries, context_kv[layer](memory, c10::nullopt, isa)}, -1), cos, sin,
                 heads, heads, k_cache.select(0, layer), v_cache.select(0, layer), slots, isa);
    const at::Tensor root_row = embed.index_select(0, at::tensor({root}, at::kLong)).to(at::kFloat);
    at::Tensor x = at::cat({root_row, mask.expand({block, hidden})});
    if (anchor_in) x = x + (*anchor_in)(memory.slice(0, n - 1), c10::nullopt, isa);
    if (root_in) x = x + (*root_in)(root_row, c10::nullopt, isa);
    // the block: rows at slots past + n .. past + n + block, each seeing all of them
    const int64_t rows = block + 1, start = past + n;
    const at::Tensor block_slots = at::arange(start, start + rows, at::kLong);
    const at::Tensor keys = block_slots.to(at::kInt).expand({rows, rows}).contiguous();
    const PackedPlan plan({k_cache}, {v_cache}, {start}, {block_slots}, {keys},
                          {at::full({rows}, rows, at::kInt)});
    const at::Tensor out = stack.forward(x.contiguous(), 0, layers, plan,
                                         cos_table.index_select(0, block_slots),
                                         sin_table.index_select(0, block_slots), isa);
    return rms_norm(out.slice(0, 1).contiguous(), out_weight, eps, isa);
  }
};

}  // namespace

// the threads a kernel's parallel_for runs on (1 where the extension was built without OpenMP)
int64_t parallel_threads(int64_t items) {
  std::vector<int> used(at::get_num_threads(), 0);
  at::parallel_for(0, items, 1, [&](int64_t, int64_t) { used[at::get_thread_num()] = 1; });
  return std::count(used.begin(), used.end(), 1);
}

#include "q8_blocks.h"
#include "small_codes.h"
#include "repack.h"

// Every entry point that computes runs without Python's GIL (``nogil``), so a second Python
// thread (PEARL's drafter, proposers/pearl.py) runs its own model meanwhile. pybind11 converts
// the arguments before the guard is made and the result after it is gone, so only the C++ body
// runs unlocked; the bodies touch no Python object, and each OpenMP team is the calling
// thread's own (omp_set_num_threads, hence torch.set_num_threads, is per thread).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("isa_level", &detect_isa,
        "3: AMX tiles (granted by the OS), 2: AVX-512 with VNNI, 1: AVX2 + FMA, 0: baseline x86-64");
  m.def("dense_linear", &dense_linear, nogil);
  m.def("q4_linear", &q4_linear, nogil);
  m.def("q8_linear", &q8_linear, nogil);
  m.def("small_codes_linear", &small_codes_linear, py::arg("x"), py::arg("packed"), py::arg("layout"),
        py::arg("minimum"), py::arg("residual"), py::arg("n"), py::arg("isa"),
        py::arg("input_scale") = 1.0, py::arg("codebook") = py::none(),
        py::arg("scaled_columns") = -1, nogil);
  m.def("q4_uses_amx", &q4_uses_amx, "whether q4_linear runs m rows on the AMX tiles at this isa level");
  m.def("rms_norm", &rms_norm, nogil);
  m.def("swiglu", &swiglu, nogil);
  m.def("geglu", &geglu, nogil);
  m.def("oss_glu", &oss_glu, nogil);
  m.def("softcap", &softcap, nogil);
  m.def("draw_tokens", &draw_tokens, nogil);
  m.def("top_probs", &top_probs, nogil);
  m.def("rope_store", &rope_store, nogil);
  m.def("attention", &attention, nogil, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("past"), py::arg("slots"), py::arg("lens"), py::arg("window"), py::arg("softcap"),
        py::arg("isa"), py::arg("sinks") = py::none());
  m.def("parallel_threads", &parallel_threads, nogil);
  m.def("decode_blocks", &repack::decode_blocks, nogil);
  m.def("q4_nibbles", &repack::q4_nibbles, nogil);
  m.def("pack_q4_blocks", &repack::pack_q4_blocks, nogil);
  m.def("pack_q6k", &repack::pack_q6k, nogil);
  m.def("pack_five_bit", &repack::pack_five_bit, nogil);
  py::class_<MoEExperts>(m, "MoEExperts")
      .def(py::init<std::vector<PackedLinear>, std::vector<PackedLinear>, int64_t,
                    std::vector<at::Tensor>, std::vector<at::Tensor>>())
      .def("forward", &MoEExperts::forward, nogil);
  py::class_<PackedLinear>(m, "PackedLinear")
      .def(py::init<at::Tensor, int64_t, int64_t, int64_t, bool, bool, double,
                    c10::optional<at::Tensor>, int64_t>())
      .def(py::init<std::vector<PackedLinear>>());
  py::class_<LayerStack>(m, "LayerStack")
      .def(py::init<std::vector<at::Tensor>, std::vector<PackedLinear>, std::vector<PackedLinear>,
                    std::vector<at::Tensor>, std::vector<PackedLinear>, std::vector<PackedLinear>,
                    std::vector<int64_t>, int64_t, int64_t, int64_t, int64_t, double,
                    std::vector<at::Tensor>>())
      .def("forward", &LayerStack::forward, nogil);
  py::class_<EagleHead>(m, "EagleHead")
      .def(py::init<LayerStack, PackedLinear, c10::optional<PackedLinear>, at::Tensor, at::Tensor,
                    at::Tensor, at::Tensor, double>())
      .def("ingest", &EagleHead::ingest, nogil)
      .def("expand", &EagleHead::expand, nogil);
  py::class_<DeerDrafter>(m, "DeerDrafter")
      .def(py::init<LayerStack, PackedLinear, std::vector<PackedLinear>, c10::optional<PackedLinear>,
                    c10::optional<PackedLinear>, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                    at::Tensor, int64_t, int64_t, double>())
      .def("ingest", &DeerDrafter::ingest, nogil);
  py::class_<HydraHeads>(m, "HydraHeads")
      .def(py::init<std::vector<PackedLinear>, std::vector<c10::optional<at::Tensor>>,
                    std::vector<PackedLinear>, std::vector<c10::optional<at::Tensor>>, at::Tensor>())
      .def("forward", &HydraHeads::forward, nogil);
  py::class_<PackedPlan>(m, "PackedPlan")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<int64_t>,
                    std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>>())
      .def("rope_store", &PackedPlan::rope_store, nogil)
      .def("attention", &PackedPlan::attention, nogil, py::arg("layer"), py::arg("q"),
           py::arg("window"), py::arg("softcap"), py::arg("isa"), py::arg("sinks") = py::none());
}
