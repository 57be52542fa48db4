// The AMX level's tile products (Intel's Advanced Matrix Extensions: Sapphire Rapids and later Xeons): tdpbf16ps
// multiplies up to 16 rows of x by 16 output rows at once (bfloat16 pairs, float32 sums) on 16 x 16 tiles.
// The packed layouts are already the tiles' (a pair of columns of 16 rows is one 64-byte tile row, VNNI's
// order), so the weights are the other levels' and one copy serves. Every row count takes the tiles, one row
// as sixty-four: a row's sums then never depend on the rows beside it (docs/configuration.md, CPU kernels).
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int64_t kAmxPairs = 16;  // a tile's depth: 16 pairs of columns (32 bfloat16) of x and of the weights

// Linux lends a process AMX's tile state only once asked (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA,
// kernel 5.16 and later); without it the first tile instruction kills the process. Asked once; where it is
// refused the AVX512-BF16 loops run instead.
inline bool amx_usable() {
  static const bool usable = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  return usable;
}

// The tiles' shapes, configured in the thread that uses them while it holds one (tiles are per-thread state):
// 0-3 sums (``rows`` x 16 float32), 4 x (``rows`` x 32 bfloat16), 5-7 weights (16 pairs x 16 rows x 2).
struct Tiles {
  const bool held;
  Tiles(bool wanted, int64_t rows) : held(wanted) {
    if (!held) return;
    struct alignas(64) {
      uint8_t palette = 1, start_row = 0, reserved[14] = {};
      uint16_t bytes[16] = {};
      uint8_t rows[16] = {};
    } config;
    for (int t = 0; t < 8; ++t) config.bytes[t] = 64, config.rows[t] = t < 5 ? rows : 16;
    _tile_loadconfig(&config);
  }
  ~Tiles() {
    if (held) _tile_release();
  }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};

// out[rows][64] (+)= a tile's rows of x (bfloat16 pairs, ``ldx`` pairs a row, from the slice's first pair) . a
// group's slice of ``count`` packed pairs (a multiple of 16) from ``wb``: four tiles of sums, one per 16
// output rows; the weights' tile rows lie 256 bytes apart (a pair of the group's 64 rows).
inline void amx_slice(const uint32_t* x, int64_t ldx, const c10::BFloat16* wb, int64_t count, float* out, bool first) {
  constexpr int kOut = kGroup * sizeof(float), kPair = kGroup * 2 * sizeof(c10::BFloat16);
  if (first) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, out, kOut);
    _tile_loadd(1, out + 16, kOut);
    _tile_loadd(2, out + 32, kOut);
    _tile_loadd(3, out + 48, kOut);
  }
  for (int64_t p = 0; p < count; p += kAmxPairs) {  // three weight tiles in turn: a load never waits on the last product
    const c10::BFloat16* w = wb + p * kGroup * 2;
    _tile_loadd(4, x + p, ldx * sizeof(uint32_t));
    _tile_loadd(5, w, kPair);
    _tile_loadd(6, w + 32, kPair);
    _tile_loadd(7, w + 64, kPair);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, w + 96, kPair);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, out, kOut);
  _tile_stored(1, out + 16, kOut);
  _tile_stored(2, out + 32, kOut);
  _tile_stored(3, out + 48, kOut);
}

// int4: one half of a group (32 output rows) for every row of x. Per 32-column block, its nibbles widened
// exactly to bfloat16 (kernels_bf16.h's kNibbles) into two tiles of 16 rows, the tiles' sums of x . q, then,
// in registers as the other levels, out += sums x d + (x's block sum) x m (Q4_1's w = d q + m).
inline void amx_int4_half(const TileRows& x, int64_t pairs, const float* xsum, int64_t columns, const uint8_t* nibbles,
                          const c10::Half* scales, float* out) {
  const __m512i table = _mm512_load_si512(kNibbles);
  alignas(64) c10::BFloat16 low[kAmxPairs * 32], high[kAmxPairs * 32];  // rows 0-15 and 16-31 of the half
  alignas(64) float sums[2][16 * 16];
  for (int64_t c = 0; c < columns; ++c, scales += 64) {
    for (int64_t p = 0; p < kAmxPairs; ++p, nibbles += 32) {
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles)));
      _mm512_store_si512(low + 32 * p, _mm512_permutexvar_epi16(v, table));
      _mm512_store_si512(high + 32 * p, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table));
    }
    const __m512 d0 = half16(scales), d1 = half16(scales + 16), m0 = half16(scales + 32), m1 = half16(scales + 48);
    _tile_loadd(5, low, 64);
    _tile_loadd(6, high, 64);
    for (int64_t first = 0; first < x.total; first += 16) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_loadd(4, x.x + first * pairs + c * kAmxPairs, pairs * sizeof(uint32_t));
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 6);
      _tile_stored(0, sums[0], 64);
      _tile_stored(1, sums[1], 64);
      for (int64_t m = first; m < std::min(first + 16, x.count); ++m) {
        const int64_t i = m - first;
        float* o = out + m * kGroup;
        const __m512 s = _mm512_set1_ps(xsum[m * columns + c]);
        const __m512 a0 = c ? _mm512_loadu_ps(o) : _mm512_setzero_ps(), a1 = c ? _mm512_loadu_ps(o + 16) : _mm512_setzero_ps();
        _mm512_storeu_ps(o, _mm512_fmadd_ps(m0, s, _mm512_fmadd_ps(_mm512_load_ps(sums[0] + 16 * i), d0, a0)));
        _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(m1, s, _mm512_fmadd_ps(_mm512_load_ps(sums[1] + 16 * i), d1, a1)));
      }
    }
  }
}

}  // namespace
