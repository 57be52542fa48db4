// The AMX level's tile product (Intel's Advanced Matrix Extensions: Sapphire Rapids and later Xeons): for 16
// or more rows of x, llm/kernels.cpp's loops hand each packed slice to amx_slice, which multiplies 16 rows of
// x by a group's 64 output rows with tdpbf16ps (bfloat16 pairs, float32 sums) on 16 x 16 tiles; fewer rows
// keep the AVX512-BF16 inner loops (kernels_bf16.h), which read the weights faster for a decode step of one
// or a few rows (docs/benchmark.md, "AMX"). The packed layout is already the tiles' (a pair of columns of 16
// rows is one 64-byte tile row, VNNI's order), so one copy of the weights serves both, with the same sums.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr bool kAmx = true;
constexpr int64_t kAmxPairs = 16;  // a tile's rows: 16 rows of x, or 16 pairs of columns of weights

// Linux lends a process AMX's tile state only once asked (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA,
// kernel 5.16 and later); without it the first tile instruction kills the process. Asked once; where it is
// refused the AVX512-BF16 loops run instead.
inline bool amx_usable() {
  static const bool usable = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  return usable;
}

// The tiles' shapes, configured in the thread that uses them while it holds one (tiles are per-thread state):
// 0-3 sums (16 rows x 16 float32), 4 x (16 rows x 32 bfloat16), 6-7 weights (16 pairs x 16 columns x 2).
struct Tiles {
  const bool held;
  explicit Tiles(bool wanted) : held(wanted) {
    if (!held) return;
    struct alignas(64) {
      uint8_t palette = 1, start_row = 0, reserved[14] = {};
      uint16_t bytes[16] = {};
      uint8_t rows[16] = {};
    } config;
    for (int t = 0; t < 8; ++t) config.bytes[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
  }
  ~Tiles() {
    if (held) _tile_release();
  }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};

// out[16 rows][64] (+)= 16 rows of x (bfloat16 pairs, ``ldx`` pairs a row, from the slice's first pair) . a
// group's slice of ``count`` packed pairs (a multiple of 16) from ``wb``. Four tiles of sums, one per 16
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
  for (int64_t p = 0; p < count; p += kAmxPairs) {
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

}  // namespace
