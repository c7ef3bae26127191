// Portable kernels of the native runner, included once per instruction set (cpu_kernels.cpp
// compiles this file under several `#pragma GCC target` regions, each in its own namespace).
//
// The rule every function here keeps: an output element is computed by one thread, with a
// sequence of floating-point operations that depends only on the model's sizes (K, D, H, a
// row's own context length), never on how many rows share the call or where a row sits in it.
// Reductions go through fixed "lanes" (element i adds into lane i % 16, in index order) folded
// by a fixed pairwise tree; products that should fuse are written as std::fma, and the file is
// compiled with -ffp-contract=off, so the compiler fuses nothing else. The same code compiled
// for AVX-512, AVX2 or baseline x86-64 therefore gives the same bits.

static inline float tree16(float* part) {
  for (int s = 8; s > 0; s /= 2)
    for (int l = 0; l < s; l++) part[l] += part[l + s];
  return part[0];
}

static inline float dot_lanes(const float* a, const float* b, int n) {
  float part[16] = {0};
  int i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; l++) part[l] = FMA(a[i + l], b[i + l], part[l]);
  for (int l = 0; i + l < n; l++) part[l] = FMA(a[i + l], b[i + l], part[l]);
  return tree16(part);
}

// sum of e[0 .. n - 1] through the 16 lanes
static inline float lane_sum(const float* e, int64_t n) {
  float part[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; l++) part[l] += e[i + l];
  for (int l = 0; i + l < n; l++) part[l] += e[i + l];
  return tree16(part);
}

// exp(x) for x in [-87, 88] (clamped): Cephes' expf polynomial (about 1 ulp), branch-free so
// that it vectorises, and the same bits in every lane and on every instruction set.
static inline float exp_fixed(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  float r = FMA(n, -0.693359375f, x);
  r = FMA(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = FMA(p, r, 1.3981999507e-3f);
  p = FMA(p, r, 8.3334519073e-3f);
  p = FMA(p, r, 4.1665795894e-2f);
  p = FMA(p, r, 1.6666665459e-1f);
  p = FMA(p, r, 5.0000001201e-1f);
  p = FMA(p, r * r, r) + 1.0f;
  int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

static inline float half_to_float(uint16_t h) {
  // exact IEEE binary16 -> binary32 (finite values: GGUF scales)
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { man <<= 1; e++; } while (!(man & 0x400));
      bits = sign | (uint32_t)(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
    }
  } else {
    bits = sign | (exp + 112) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

static void rms_norm_rows(const float* x, const float* w, float* y, int64_t m, int64_t h,
                          float eps) {
  for (int64_t r = 0; r < m; r++) {
    const float* xr = x + r * h;
    float ms = dot_lanes(xr, xr, (int)h) / (float)h;
    float inv = 1.0f / __builtin_sqrtf(ms + eps);
    for (int64_t i = 0; i < h; i++) y[r * h + i] = (xr[i] * inv) * w[i];
  }
}

// y[i] = silu(g[i]) * u[i] = g[i] * u[i] / (1 + exp(-g[i])) for i < n (SWIGLU_SPAN is this, or
// an instruction-set version of it with the same operations)
static void swiglu_span(const float* g, const float* u, float* y, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] = g[i] * u[i] / (1.0f + exp_fixed(-g[i]));
}

// silu(gate) * up for [m, 2I] rows (gate then up)
static void swiglu_rows(const float* gu, float* y, int64_t m, int64_t inter) {
  for (int64_t r = 0; r < m; r++) {
    const float* g = gu + r * 2 * inter;
    SWIGLU_SPAN(g, g + inter, y + r * inter, inter);
  }
}

// tanh through exp_fixed (1 - 2 / (exp(2x) + 1)): elementwise, the same bits in every lane and
// variant (a library tanh differs between its vector body and its scalar tail)
static inline float tanh_fixed(float x) { return 1.0f - 2.0f / (exp_fixed(2.0f * x) + 1.0f); }

// gelu_tanh(gate) * up for [m, 2I] rows (gate then up), transformers' gelu_pytorch_tanh:
// 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) (Gemma's GeGLU MLP)
static void geglu_rows(const float* gu, float* y, int64_t m, int64_t inter) {
  for (int64_t r = 0; r < m; r++) {
    const float* g = gu + r * 2 * inter;
    const float* u = g + inter;
    for (int64_t i = 0; i < inter; i++) {
      const float inner = 0.7978845608028654f * (g[i] + 0.044715f * (g[i] * g[i] * g[i]));
      y[r * inter + i] = (0.5f * g[i]) * (1.0f + tanh_fixed(inner)) * u[i];
    }
  }
}

// gpt-oss's clamped SwiGLU for [m, 2I] rows (gate then up): g = min(gate, 7),
// u = clamp(up, -7, 7), out = (u + 1) * g * sigmoid(1.702 g) (modeling_gpt_oss's experts)
static void oss_glu_rows(const float* gu, float* y, int64_t m, int64_t inter) {
  for (int64_t r = 0; r < m; r++) {
    const float* g = gu + r * 2 * inter;
    const float* u = g + inter;
    for (int64_t i = 0; i < inter; i++) {
      const float gate = g[i] > 7.0f ? 7.0f : g[i];
      const float up = u[i] > 7.0f ? 7.0f : (u[i] < -7.0f ? -7.0f : u[i]);
      y[r * inter + i] = (up + 1.0f) * (gate / (1.0f + exp_fixed(-1.702f * gate)));
    }
  }
}

// cap * tanh(x / cap) elementwise (logit soft-capping)
static void softcap_values(const float* x, float* y, int64_t n, float cap) {
  for (int64_t i = 0; i < n; i++) y[i] = tanh_fixed(x[i] / cap) * cap;
}

// float32 -> bfloat16 bits, rounded to nearest even (NaN stays NaN): the same bits on every
// CPU; branch-free, so that the cache writes below vectorise
static inline uint16_t to_bfloat16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? (bits >> 16) | 0x40 : rounded);
}

static inline void put(float* cache, int64_t at, float x) { cache[at] = x; }
static inline void put(uint16_t* cache, int64_t at, float x) { cache[at] = to_bfloat16(x); }

// the largest head size the rotary embedding takes (a head's rotated values are kept on the
// stack)
constexpr int64_t ROPE_MAX_D = 512;

// Rotary embedding of m rows [H + 2 KH heads of D]: query heads into qp [m, H, D], key heads
// into their cache slot (keys [KH, capacity / 16, D, 16], values [KH, capacity, D]). Each
// value is x c + x' s with x' the element half a head away (two products and a sum, no fma).
template <typename KV>
static void rope_store_rows(const float* src, const float* cos, const float* sin, int64_t m,
                            int64_t d, int64_t heads, int64_t kv_heads, int64_t cap,
                            const int64_t* slot, float* qp, KV* kp, KV* vp) {
  const int64_t half = d / 2;
  float turned[ROPE_MAX_D];
  for (int64_t r = 0; r < m; r++) {
    const float* row = src + r * (heads + 2 * kv_heads) * d;
    const float *c = cos + r * d, *s = sin + r * d;
    for (int64_t h = 0; h < heads + kv_heads; h++) {
      const float* x = row + h * d;
      float* out = h < heads ? qp + (r * heads + h) * d : turned;
      for (int64_t i = 0; i < half; i++) out[i] = x[i] * c[i] + x[i + half] * s[i];
      for (int64_t i = half; i < d; i++) out[i] = x[i] * c[i] + x[i - half] * s[i];
      if (h < heads) continue;
      KV* keys = kp + (h - heads) * cap * d + (slot[r] / 16) * d * 16 + slot[r] % 16;
      for (int64_t i = 0; i < d; i++) put(keys, i * 16, turned[i]);
    }
    for (int64_t h = 0; h < kv_heads; h++) {
      const float* x = row + (heads + kv_heads + h) * d;
      KV* values = vp + (h * cap + slot[r]) * d;
      for (int64_t i = 0; i < d; i++) put(values, i, x[i]);
    }
  }
}

// ---- drawing a token from a row of logits (the data writer's sampler) -----------------------

// e[i] = exp(x[i] / temperature - top) (k_avx512 and k_avx2 have their own, EXP_SCALED, 16 and
// 8 lanes a step)
static void exp_scaled(const float* x, float* e, int64_t n, float temperature, float top) {
  for (int64_t i = 0; i < n; i++) e[i] = exp_fixed(x[i] / temperature - top);
}

// the largest of x[0 .. v - 1] (-inf if none is larger; NaN never counts; k_avx512 has its own,
// ROW_MAX)
static float row_max(const float* x, int64_t v) {
  float part[16];
  for (int l = 0; l < 16; l++) part[l] = -INFINITY;
  int64_t i = 0;
  for (; i + 16 <= v; i += 16)
    for (int l = 0; l < 16; l++) part[l] = x[i + l] > part[l] ? x[i + l] : part[l];
  for (int l = 0; i + l < v; l++) part[l] = x[i + l] > part[l] ? x[i + l] : part[l];
  float top = part[0];
  for (int l = 1; l < 16; l++) top = part[l] > top ? part[l] : top;
  return top;
}

// the first index of the row's largest value (0 if every value is NaN or -inf)
static int64_t first_argmax(const float* x, int64_t v) {
  const float top = ROW_MAX(x, v);
  for (int64_t j = 0; j < v; j++)
    if (x[j] == top) return j;
  return 0;
}

// elements of one block of the cumulative search: the draw first walks the blocks' sums, then
// the elements of the block it lands in
constexpr int64_t DRAW_BLOCK = 256;

// A token from softmax(x / temperature) restricted to its top-p nucleus: for each uniform of
// u[0 .. tries - 1] in turn, the token where u * (total mass) falls in the cumulative mass (in
// index order, by blocks), kept if the tokens more probable than it hold at most top_p of the
// mass; -1 if no uniform gives a kept token. Draws repeated until one is kept are distributed
// as the nucleus, renormalised (the nucleus holds at least top_p, so a draw is kept with chance
// top_p or more). `e`: V floats of scratch; `sums`: V / DRAW_BLOCK + 1.
static int64_t nucleus_draw(const float* x, int64_t v, float temperature, const float* u,
                            int64_t tries, float top_p, float* e, float* sums) {
  // dividing by a positive temperature keeps the order: the largest of x / temperature is
  // the largest of x, divided
  EXP_SCALED(x, e, v, temperature, ROW_MAX(x, v) / temperature);
  const int64_t blocks = (v + DRAW_BLOCK - 1) / DRAW_BLOCK;
  float total = 0.0f;
  for (int64_t b = 0; b < blocks; b++) {
    sums[b] = lane_sum(e + b * DRAW_BLOCK, std::min(DRAW_BLOCK, v - b * DRAW_BLOCK));
    total += sums[b];
  }
  for (int64_t t = 0; t < tries; t++) {
    const float target = u[t] * total;
    float below = 0.0f;  // the mass before block b
    int64_t b = 0;
    while (b + 1 < blocks && below + sums[b] <= target) below += sums[b++];
    int64_t token = b * DRAW_BLOCK;
    const int64_t end = std::min(v, token + DRAW_BLOCK);
    // (the block's last token where rounding leaves the target past the block's own sum)
    for (; token + 1 < end; token++) {
      below += e[token];
      if (below > target) break;
    }
    const float p = e[token];
    float part[16] = {0};
    int64_t j = 0;
    for (; j + 16 <= v; j += 16)
      for (int l = 0; l < 16; l++) part[l] += e[j + l] > p ? e[j + l] : 0.0f;
    for (int l = 0; j + l < v; l++) part[l] += e[j + l] > p ? e[j + l] : 0.0f;
    if (tree16(part) <= top_p * total) return token;
  }
  return -1;
}

// (DISPATCH calls void functions)
static void first_argmax_into(const float* x, int64_t v, int64_t* token) { *token = first_argmax(x, v); }
static void nucleus_draw_into(const float* x, int64_t v, float temperature, const float* u,
                              int64_t tries, float top_p, float* e, float* sums, int64_t* token) {
  *token = nucleus_draw(x, v, temperature, u, tries, top_p, e, sums);
}

// ---- ranking a drafter's candidates (the draft tree's children) ---------------------------

// the first i in [from, v) with e[i] > threshold, else v (k_avx512 has its own, NEXT_ABOVE,
// 16 values a compare)
static int64_t next_above(const float* e, int64_t from, int64_t v, float threshold) {
  while (from < v && !(e[from] > threshold)) from++;
  return from;
}

// The `limit` most probable tokens of softmax(x) over x[0 .. v - 1] (limit <= v), the most
// probable first and of equal ones the lower index first: ids[j] and probs[j] = exp(x - max) /
// the row's sum (exp_fixed's). A logit of -inf has probability 0 and is never ranked (the
// places left are -1 and 0). `e`: v floats of scratch.
static void top_probs(const float* x, int64_t v, int64_t limit, float* e, int64_t* ids,
                      float* probs) {
  EXP_SCALED(x, e, v, 1.0f, ROW_MAX(x, v));
  const float total = lane_sum(e, v);
  for (int64_t j = 0; j < limit; j++) ids[j] = -1, probs[j] = 0.0f;
  int64_t kept = 0;
  // a candidate must beat the last kept one (strictly: an equal later index ranks after it);
  // until `limit` are kept, anything above -1 (every exp) does
  for (int64_t i = NEXT_ABOVE(e, 0, v, -1.0f); i < v;
       i = NEXT_ABOVE(e, i + 1, v, kept == limit ? probs[limit - 1] : -1.0f)) {
    if (x[i] == -INFINITY) continue;
    int64_t j = kept < limit ? kept++ : limit - 1;
    for (; j > 0 && probs[j - 1] < e[i]; j--) ids[j] = ids[j - 1], probs[j] = probs[j - 1];
    ids[j] = i, probs[j] = e[i];
  }
  for (int64_t j = 0; j < kept; j++) probs[j] /= total;
}

// Write a tile's sums [rows][16] for output rows r0.. and column tile t, the last tile cut at
// n columns: y = residual + sum * scale (each optional; scale per column).
static inline void store_tile(const float* acc, int rows, int64_t r0, int64_t t, int64_t n,
                              const float* scale, const float* residual, float* y) {
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < 16 && t * 16 + c < n; c++) {
      const int64_t col = t * 16 + c, at = (r0 + r) * n + col;
      const float v = scale ? acc[r * 16 + c] * scale[col] : acc[r * 16 + c];
      y[at] = residual ? residual[at] + v : v;
    }
}

// Dense weights packed [N / 16][K][16]; acc[r][c] = sum over k in order of fma(x, w, acc).
// DENSE_TILE is this tile, or an instruction-set version of it with the same operations.
template <typename W, int R>
static void dense_tile(const float* x, int64_t k_dim, const W* w, float* acc) {
  float a[R][16] = {};
  for (int64_t k = 0; k < k_dim; k++) {
    float wv[16];
    for (int c = 0; c < 16; c++) wv[c] = load_weight(w[k * 16 + c]);
    for (int r = 0; r < R; r++) {
      float xv = x[r * k_dim + k];
      for (int c = 0; c < 16; c++) a[r][c] = FMA(xv, wv[c], a[r][c]);
    }
  }
  std::memcpy(acc, a, sizeof(a));
}

template <typename W>
static void dense_columns(const float* x, int64_t m, int64_t k_dim, const W* packed,
                          const float* scale, const float* residual, float* y, int64_t n,
                          int64_t t0, int64_t t1) {
  float acc[4 * 16];
  for (int64_t t = t0; t < t1; t++) {
    const W* w = packed + t * k_dim * 16;
    for (int64_t r0 = 0; r0 < m; r0 += 4) {
      int rows = (int)std::min<int64_t>(4, m - r0);
      const float* xr = x + r0 * k_dim;
      switch (rows) {
        case 4: DENSE_TILE<W, 4>(xr, k_dim, w, acc); break;
        case 3: DENSE_TILE<W, 3>(xr, k_dim, w, acc); break;
        case 2: DENSE_TILE<W, 2>(xr, k_dim, w, acc); break;
        default: DENSE_TILE<W, 1>(xr, k_dim, w, acc); break;
      }
      store_tile(acc, rows, r0, t, n, scale, residual, y);
    }
  }
}

// 4-bit weights (GGUF Q4_1: w = d * q + m per 32 inputs) times int8 activations quantised per
// row and per 32 (x ~ dx * xq). Block of one column tile and one group: 256 bytes of codes
// (byte 4c + i of slice j holds input 4j + i of column c in its low nibble and input
// 16 + 4j + i in its high nibble), then d and m of the 16 columns as float16.
// The integer dot product of a group is exact, so only the float folds order the result:
// acc = fma(isum, d * dx, acc); acc = fma(m, dx * sum(xq), acc), group after group.
static void q4_columns_generic(const int8_t* xq, const float* dx, const float* sx, int64_t m,
                               int64_t k_dim, const uint8_t* packed, const float* residual,
                               float* y, int64_t n, int64_t t0, int64_t t1) {
  const int64_t groups = k_dim / 32;
  for (int64_t t = t0; t < t1; t++) {
    for (int64_t r = 0; r < m; r++) {
      float acc[16] = {};
      const int8_t* xr = xq + r * k_dim;
      for (int64_t g = 0; g < groups; g++) {
        const uint8_t* blk = packed + (t * groups + g) * Q4_BLOCK;
        const int8_t* xg = xr + g * 32;
        int32_t isum[16] = {};
        for (int j = 0; j < 4; j++)
          for (int c = 0; c < 16; c++)
            for (int i = 0; i < 4; i++) {
              uint8_t b = blk[j * 64 + 4 * c + i];
              isum[c] += (int32_t)(b & 15) * xg[4 * j + i] + (int32_t)(b >> 4) * xg[16 + 4 * j + i];
            }
        const uint16_t* dm = reinterpret_cast<const uint16_t*>(blk + 256);
        float gx = dx[r * groups + g], gs = sx[r * groups + g];
        for (int c = 0; c < 16; c++) {
          acc[c] = FMA((float)isum[c], half_to_float(dm[c]) * gx, acc[c]);
          acc[c] = FMA(half_to_float(dm[16 + c]), gs, acc[c]);
        }
      }
      store_tile(acc, 1, r, t, n, nullptr, residual, y);
    }
  }
}

// Attention of one (row, head): keys are logical positions 0..len-1, position j held in cache
// slot j for j < past and slots[j - past] after (a tree row's ancestors in depth order, so it
// sees the same keys in the same order as plain decoding will after the commit). Keys are
// cached in blocks of 16 slots, kt [capacity / 16][D][16], so that a score is one fma chain
// over d in order whether it is computed 16 keys at a time (slots before the forward) or alone
// (its own rows). Values [capacity][D]: out[i] = sum over keys in order of fma(p, v[i], out[i]),
// then / sum p. KV: float, or uint16_t for a bfloat16 cache (read exactly as float32). A
// ``cap`` > 0 soft-caps each score to cap * tanh(score / cap) before the softmax (softcap_values,
// elementwise: a score's bits depend on that score alone); 0 skips it. A ``sink`` (gpt-oss's
// attention sink, null: none) is one more logit of the head's own in the softmax: it joins the
// maximum and the denominator and carries no value, so the row's weights sum to less than 1.
static inline int64_t key_at(int64_t slot, int64_t i, int64_t d) {
  return (slot / 16) * d * 16 + i * 16 + slot % 16;
}

// the score of the key in cache slot `slot`: one fma chain over d, as a block's lane computes it
template <typename KV>
static inline float key_score(const float* q, const KV* kt, int64_t slot, int64_t d) {
  const KV* key = kt + key_at(slot, 0, d);
  float acc = 0.0f;
  for (int64_t i = 0; i < d; i++) acc = FMA(q[i], load_weight(key[i * 16]), acc);
  return acc;
}

// scores -> exp(score - max) in place; returns their sum through the 16 lanes, plus the
// sink's exp where there is one (it joins the maximum and the denominator)
static float softmax_numerators(float* scores, int64_t len, const float* sink) {
  const float top = ROW_MAX(scores, len);
  const float mx = sink && *sink > top ? *sink : top;
  for (int64_t j = 0; j < len; j++) scores[j] = exp_fixed(scores[j] - mx);
  return sink ? lane_sum(scores, len) + exp_fixed(*sink - mx) : lane_sum(scores, len);
}

template <typename KV>
static void attend_one(const float* q, const KV* kt, const KV* vc, int64_t d,
                       int64_t past, const int32_t* slots, int64_t len, float* scores,
                       float* out, float cap, const float* sink) {
  int64_t j0 = 0;
  for (; j0 + 16 <= past; j0 += 16) {
    float acc[16] = {};
    for (int64_t i = 0; i < d; i++) {
      const float qi = q[i];
      const KV* row = kt + key_at(j0, i, d);
      for (int l = 0; l < 16; l++) acc[l] = FMA(qi, load_weight(row[l]), acc[l]);
    }
    for (int l = 0; l < 16; l++) scores[j0 + l] = acc[l];
  }
  for (int64_t j = j0; j < len; j++) scores[j] = key_score(q, kt, j < past ? j : slots[j - past], d);
  if (cap > 0.0f) softcap_values(scores, scores, len, cap);  // Gemma 2's logit soft-capping
  const float denom = softmax_numerators(scores, len, sink);
  for (int64_t i = 0; i < d; i++) out[i] = 0.0f;
  for (int64_t jj = 0; jj < len; jj++) {
    const int64_t s = jj < past ? jj : slots[jj - past];
    const KV* v = vc + s * d;
    const float p = scores[jj];
    for (int64_t i = 0; i < d; i++) out[i] = FMA(p, load_weight(v[i]), out[i]);
  }
  for (int64_t i = 0; i < d; i++) out[i] = out[i] / denom;
}

// attend_one for the nh query heads (q and out: nh rows of D) that share one key/value head;
// sinks: theirs (null: none)
template <typename KV>
static void attend_group(const float* q, const KV* kt, const KV* vc, int64_t d,
                         int64_t past, const int32_t* slots, int64_t len, float* scores,
                         float* out, int64_t nh, float cap, const float* sinks) {
  for (int64_t h = 0; h < nh; h++)
    attend_one(q + h * d, kt, vc, d, past, slots, len, scores, out + h * d, cap,
               sinks ? sinks + h : nullptr);
}
