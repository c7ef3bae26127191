// What a group of the AMX int4 kernel (src/specdecode/kernels/amx.h) costs, piece by piece: one
// column tile, 64 groups of 32 inputs, R rows; the fold alone (VNNI's float operations), the
// tile operations alone (TDPBSUD with its tile loads, then the tile store), both, and both with
// each weight tile unpacked right before its multiply or four groups ahead. Best of 50 runs.
//
//   gcc -O2 -o /tmp/amx_tile_costs scripts/amx_tile_costs.c && /tmp/amx_tile_costs
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define G 64
#define T __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,f16c,fma")))
// tileloadd and ldtilecfg with their memory declared (GCC 12's intrinsics declare too little)
#define TLOAD(tmm, base, stride) \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #tmm ::"r"(base), "r"((long)(stride)) : "memory")

static int8_t xq[16 * G * 32] __attribute__((aligned(64)));
static uint8_t packed[G * 320] __attribute__((aligned(64)));
static uint8_t tiles[G * 512] __attribute__((aligned(64)));
static int32_t sums[2][256] __attribute__((aligned(64)));
static float dx[16 * G], sx[16 * G];
static volatile float sink;

T static inline void fold(const int32_t* s, int g, __m512* acc, int rows) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(packed + g * 320 + 256)));
  const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(packed + g * 320 + 288)));
  for (int r = 0; r < rows; r++) {
    const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[r * G + g]));
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(s + 16 * r)), scale, acc[r]);
    acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sx[r * G + g]), acc[r]);
  }
}

T static inline void unpack(int g) {
  const __m512i low = _mm512_set1_epi8(15);
  for (int j = 0; j < 4; j++) {
    const __m512i v = _mm512_loadu_si512(packed + g * 320 + 64 * j);
    _mm512_store_si512(tiles + g * 512 + 64 * j, _mm512_and_si512(v, low));
    _mm512_store_si512(tiles + g * 512 + 64 * (4 + j), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
  }
}

enum { FOLD = 1, TILES = 2, STORE = 4, UNPACK_NOW = 8, UNPACK_AHEAD = 16 };

// two groups a round on tiles 0/1 (sums), 2/3 (activations), 4/5 (weights); fold one behind
T static void run(int what, int rows) {
  __m512 acc[16];
  for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
  if (what & UNPACK_AHEAD)
    for (int g = 0; g < 4; g++) unpack(g);
  for (int g = 0; g < G; g++) {
    if ((what & UNPACK_AHEAD) && g + 4 < G) unpack(g + 4);
    if (what & UNPACK_NOW) unpack(g);
    if (what & TILES) {
      if (g % 2 == 0) {
        TLOAD(2, xq + g * 32, G * 32); TLOAD(4, tiles + g * 512, 64);
        _tile_zero(0); _tile_dpbsud(0, 2, 4);
        if (what & STORE) _tile_stored(0, sums[0], 64);
      } else {
        TLOAD(3, xq + g * 32, G * 32); TLOAD(5, tiles + g * 512, 64);
        _tile_zero(1); _tile_dpbsud(1, 3, 5);
        if (what & STORE) _tile_stored(1, sums[1], 64);
      }
    }
    if ((what & FOLD) && g > 0) fold(sums[(g - 1) % 2], g - 1, acc, rows);
  }
  float total = 0;
  for (int r = 0; r < 16; r++) total += _mm512_reduce_add_ps(acc[r]);
  sink = total;
}

T static void configure(int rows) {
  struct { uint8_t palette, start, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int i = 0; i < 2; i++) {
    cfg.rows[i] = rows, cfg.colsb[i] = 64;
    cfg.rows[2 + i] = rows, cfg.colsb[2 + i] = 32;
    cfg.rows[4 + i] = 8, cfg.colsb[4 + i] = 64;
  }
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

T static void release(void) { _tile_release(); }

static double seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) {
    puts("no AMX tile state from the OS");
    return 1;
  }
  for (int i = 0; i < G; i++) memset(packed + i * 320 + 256, 0x3c, 64);  // float16 scales ~1
  const struct { int what; const char* name; } cases[] = {
      {FOLD, "fold alone"},
      {TILES, "TDPBSUD and its tile loads"},
      {TILES | STORE, "the same and the tile store"},
      {FOLD | TILES | STORE, "all three"},
      {FOLD | TILES | STORE | UNPACK_NOW, "all, unpacking each block right before its multiply"},
      {FOLD | TILES | STORE | UNPACK_AHEAD, "all, unpacking four groups ahead"},
  };
  for (int rows = 4; rows <= 16; rows *= 2) {
    configure(rows);
    for (unsigned c = 0; c < sizeof cases / sizeof cases[0]; c++) {
      double best = 1e9;
      for (int rep = 0; rep < 50; rep++) {
        const double t0 = seconds();
        for (int i = 0; i < 200; i++) run(cases[c].what, rows);
        const double t = (seconds() - t0) / 200;
        best = t < best ? t : best;
      }
      printf("%2d rows  %-55s %5.1f ns a group\n", rows, cases[c].name, best / G * 1e9);
    }
    release();
  }
  return 0;
}
