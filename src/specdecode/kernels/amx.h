// The Q4 kernel with AMX tiles (Intel Sapphire Rapids and later), included once by
// cpu_kernels.cpp after k_avx512 (whose store_tiles it uses). The target attributes below let
// g++ compile it on any x86-64 machine; it runs only where amx_usable() says the CPU has the
// tiles and the kernel has granted this process their state.
//
// The same numbers as q4_tiles_vnni, bit for bit: a group's integer sum (32 inputs of one row
// and one column) is exact in any order, so one TDPBSUD of an activation tile (rows x 32
// signed bytes) by a weight tile (8 x 64 unsigned bytes: 16 columns x 4 inputs a row) gives
// the 16 x 16 sums VPDPBUSD gives; the float fold that follows is q4_tiles_vnni's, the same
// operations in the same group order. Only the multiply-adds move from vector registers to
// the tile unit, which makes the fold (4 vector operations per 16 outputs and group) the work
// that is left.
//
// The weights stay in their Q4_1 blocks: a block's four 64-byte slices are already laid out
// as weight-tile rows (slice j's low nibbles hold inputs 4j..4j+3 of each column, its high
// nibbles inputs 16+4j..), so unpacking is an and and a shift into a 512-byte tile, written to
// a per-thread buffer of one column tile (K x 16 bytes, L2-resident) that the first block of
// 16 rows fills as it streams the weights and the later blocks read back.

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")
namespace k_amx {

// bytes of one unpacked (column tile, group): 8 rows of 16 columns x 4 inputs
constexpr int64_t UNPACKED_BLOCK = 512;
// groups between the one the unpacking pass writes and the one it multiplies
constexpr int64_t UNPACK_AHEAD = 4;

// CPUID.(7, 0):EDX bits 24 (AMX-TILE) and 25 (AMX-INT8), then the kernel's permission to use
// the tile data (Linux 5.16+: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), once per
// process, for all its threads)
static bool request_amx() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!(edx & (1u << 24)) || !(edx & (1u << 25))) return false;
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

static bool amx_usable() {
  static const bool usable = request_amx();
  return usable;
}

// the tile registers' shapes for blocks of `rows` rows and multiplies of `inputs` (32, or 64 for
// small_codes.h's Q6K) inputs (palette 1): tiles 0-1 int32 sums (rows x 16), 2-3 activations
// (rows x inputs bytes), 4-7 weights (inputs / 4 x 64 bytes: 16 columns x 4 inputs a row); pairs, so that
// one group's multiply runs while the previous group's sums are folded. A call configures them
// once, for min(its rows, 16): a last block of fewer rows multiplies 16 (the call pads the
// activations with zero rows) and folds its own. (Reconfiguring for that block, in every
// column tile, made 20 rows of 576 -> 3072 cost more than 24; padding a call of fewer than
// 16 rows to 16 made 8 rows cost 1.1-1.2x.)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

static void configure_tiles(int64_t m, int inputs = 32) {
  const uint8_t rows = (uint8_t)std::min<int64_t>(m, 16);
  TileConfig cfg;
  for (int i = 0; i < 2; i++) {
    cfg.rows[i] = rows, cfg.colsb[i] = 64;
    cfg.rows[2 + i] = rows, cfg.colsb[2 + i] = (uint16_t)inputs;
    cfg.rows[4 + i] = cfg.rows[6 + i] = (uint8_t)(inputs / 4), cfg.colsb[4 + i] = cfg.colsb[6 + i] = 64;
  }
  // ldtilecfg by hand: GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes, so the
  // stores of the shapes above may be dropped or moved past it
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

// tileloadd with the memory it reads declared (GCC 12's _tile_loadd declares none, so the
// stores of an unpacked block could be moved past the load that reads them)
#define TILE_LOAD(tmm, base, stride)                                         \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #tmm ::"r"(base), "r"((int64_t)(stride)) \
                   : "memory")

// a Q4_1 block's codes as a weight tile: rows 0-3 the slices' low nibbles, rows 4-7 the high
static inline void unpack_block(const uint8_t* blk, uint8_t* out) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int j = 0; j < 4; j++) {
    const __m512i v = _mm512_loadu_si512(blk + 64 * j);
    _mm512_store_si512(out + 64 * j, _mm512_and_si512(v, low));
    _mm512_store_si512(out + 64 * (4 + j), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
  }
}

// q4_tiles_vnni's fold of group g for R rows: sums [R][16] int32 of the group
template <int R>
__attribute__((always_inline)) static inline void fold_group(const int32_t* sums, const uint8_t* blk,
                                                             const float* dx, const float* sx,
                                                             int64_t groups, int64_t g, __m512 (&acc)[R]) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 256)));
  const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 288)));
#pragma GCC unroll 16
  for (int r = 0; r < R; r++) {
    const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[r * groups + g]));
    const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512(sums + 16 * r));
    acc[r] = _mm512_fmadd_ps(sum, scale, acc[r]);
    acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sx[r * groups + g]), acc[r]);
  }
}

// One group's sums into tile C from activation tile A and weight tile B, stored to `sums`
// (tile numbers are immediates, hence a macro)
#define AMX_GROUP(C, A, B, x, w, k_dim, sums)      \
  do {                                             \
    TILE_LOAD(A, x, k_dim);                        \
    TILE_LOAD(B, w, 64);                           \
    _tile_zero(C);                                 \
    _tile_dpbsud(C, A, B);                         \
    _tile_stored(C, sums, 64);                     \
  } while (0)

// R rows (of the min(m, 16) the tiles multiply) of one column tile: group sums on the tile
// unit, each folded while the next group multiplies. UNPACK: this pass streams the packed
// weights and writes their weight tiles to `unpacked` (the first pass over the column tile); else it
// reads them back from there. The sums stay in a local array (registers): the tile loads and
// stores tell the compiler they touch memory, so an array passed in would be stored and
// reloaded around each of them.
template <int R, bool UNPACK>
static void q4_rows_amx(const int8_t* xq, const float* dx, const float* sx, int64_t k_dim,
                        const uint8_t* tile, uint8_t* unpacked, __m512 (&out)[R][1]) {
  const int64_t groups = k_dim / 32;
  alignas(64) int32_t sums[2][16 * 16];
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  // the unpacking pass writes group g + UNPACK_AHEAD's weight tile while group g multiplies:
  // a tile load of bytes just stored waits for the stores to reach the cache (measured: about
  // twice the time of a group where each block is unpacked right before its multiply)
  auto unpack = [&](int64_t g) {
    if (!UNPACK || g >= groups) return;
    const uint8_t* blk = tile + g * Q4_BLOCK;
    for (int line = 0; line < Q4_BLOCK; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(blk + Q4_PREFETCH + line), _MM_HINT_T0);
    unpack_block(blk, unpacked + g * UNPACKED_BLOCK);
  };
  auto weights = [&](int64_t g) {
    unpack(g + UNPACK_AHEAD);
    return unpacked + g * UNPACKED_BLOCK;
  };
  for (int64_t g = 0; g < UNPACK_AHEAD; g++) unpack(g);
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    AMX_GROUP(0, 2, 4, xq + g * 32, weights(g), k_dim, sums[0]);
    if (g > 0) fold_group<R>(sums[1], tile + (g - 1) * Q4_BLOCK, dx, sx, groups, g - 1, acc);
    AMX_GROUP(1, 3, 5, xq + (g + 1) * 32, weights(g + 1), k_dim, sums[1]);
    fold_group<R>(sums[0], tile + g * Q4_BLOCK, dx, sx, groups, g, acc);
  }
  if (g < groups) {  // an odd group count: the last group alone
    AMX_GROUP(0, 2, 4, xq + g * 32, weights(g), k_dim, sums[0]);
    if (g > 0) fold_group<R>(sums[1], tile + (g - 1) * Q4_BLOCK, dx, sx, groups, g - 1, acc);
    fold_group<R>(sums[0], tile + g * Q4_BLOCK, dx, sx, groups, g, acc);
  } else {
    fold_group<R>(sums[1], tile + (groups - 1) * Q4_BLOCK, dx, sx, groups, groups - 1, acc);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; r++) out[r][0] = acc[r];
}
// (AMX_GROUP and TILE_LOAD stay defined: q8_blocks.h's tile kernel uses them, and small_codes.h's
// TILE_LOAD; each undefines what it used last)

// a per-thread buffer for one column tile's weight tiles, grown as needed (kept between calls:
// a fresh allocation of this size would be a fresh mapping, page faults included, every call)
static uint8_t* unpack_buffer(int64_t k_dim) {
  thread_local std::vector<uint8_t> buffer;
  const size_t need = (size_t)(k_dim / 32) * UNPACKED_BLOCK + 64;
  if (buffer.size() < need) buffer.resize(need);
  return reinterpret_cast<uint8_t*>(((uintptr_t)buffer.data() + 63) & ~(uintptr_t)63);
}

template <int R, bool UNPACK>
static void q4_block_amx(const int8_t* xq, const float* dx, const float* sx, int64_t r0,
                         int64_t k_dim, const uint8_t* tile, uint8_t* unpacked, int64_t t,
                         const float* residual, float* y, int64_t n) {
  const int64_t groups = k_dim / 32;
  __m512 acc[R][1];
  q4_rows_amx<R, UNPACK>(xq + r0 * k_dim, dx + r0 * groups, sx + r0 * groups, k_dim, tile,
                         unpacked, acc);
  k_avx512::store_tiles<R, 1>(acc, R, r0, t, n, residual, y);
}

// CASE(1) .. CASE(16): a switch over a block's row count (q8_blocks.h's and small_codes.h's tile
// kernels use it too; small_codes.h undefines it)
#define EVERY_TILE_ROW_COUNT(CASE)                                                       \
  CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) \
  CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)

// a block of `rows` (1..16) rows at r0 (see configure_tiles)
static void q4_block_rows(int rows, bool unpack, const int8_t* xq, const float* dx,
                          const float* sx, int64_t r0, int64_t k_dim, const uint8_t* tile,
                          uint8_t* unpacked, int64_t t, const float* residual, float* y,
                          int64_t n) {
#define AMX_ROWS_CASE(R)                                                                      \
  case R:                                                                                     \
    if (unpack)                                                                               \
      q4_block_amx<R, true>(xq, dx, sx, r0, k_dim, tile, unpacked, t, residual, y, n);        \
    else                                                                                      \
      q4_block_amx<R, false>(xq, dx, sx, r0, k_dim, tile, unpacked, t, residual, y, n);       \
    break;
  switch (rows) { EVERY_TILE_ROW_COUNT(AMX_ROWS_CASE) }
#undef AMX_ROWS_CASE
}

// q4_columns_vnni's contract on AMX: column tiles t0..t1 of y for all m rows, in blocks of 16
// rows (the last block the rest; xq holds whole blocks of 16 rows, the padding zero); the
// first block of a column tile unpacks its weights
static void q4_columns_amx(const int8_t* xq, const float* dx, const float* sx, int64_t m,
                           int64_t k_dim, const uint8_t* packed, const float* residual,
                           float* y, int64_t n, int64_t t0, int64_t t1) {
  const int64_t tile_bytes = k_dim / 32 * Q4_BLOCK, full = m / 16 * 16;
  const int rest = (int)(m - full);
  uint8_t* unpacked = unpack_buffer(k_dim);
  configure_tiles(m);
  for (int64_t t = t0; t < t1; t++) {
    const uint8_t* tile = packed + t * tile_bytes;
    for (int64_t r0 = 0; r0 < full; r0 += 16)
      q4_block_rows(16, r0 == 0, xq, dx, sx, r0, k_dim, tile, unpacked, t, residual, y, n);
    if (rest)
      q4_block_rows(rest, full == 0, xq, dx, sx, full, k_dim, tile, unpacked, t, residual, y, n);
  }
  _tile_release();  // the tile state back to its initial (small) form for context switches
}

}  // namespace k_amx
#pragma GCC pop_options
