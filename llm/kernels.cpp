// CPU kernels of our own, built by llm/kernels.py once per instruction-set level (llama.cpp's CPU variants):
// this file holds what every level shares (the packed layouts, the loops over groups of output rows and over
// the rows of x, the checks, the registration) and includes the inner loops of the level it is built for:
//
//   kernels_bf16.h  AVX512-BF16: vdpbf16ps multiplies bfloat16 pairs with float32 sums;
//   kernels_vec.h   AVX-512 (F, BW, DQ, VL) and AVX2 + FMA: bfloat16 weights widened to float32 in registers
//                   by a shift and multiplied by FMA; int8 and int4 multiplied in integers against x quantized
//                   per 32 columns to int8, as llama.cpp's Q8 dot products.
//
// For bfloat16 weights every level does the same arithmetic: float32 products of x (bfloat16, or float32 where
// the level widens) and the stored weights (exact), summed in float32; only the order of the sums differs
// between levels. int8 and int4 differ by level as said. Its ops are registered under the namespace
// the build names (KERNELS_NAMESPACE: triton_chat_avx2, triton_chat_avx512, triton_chat_avx512bf16), so one
// process can load every level the CPU runs (the tests do).
//
// A linear layer, y = x @ w.T (+ bias): a decode step multiplies a row or a few by each weight, so it is
// bound by reading the weights once, and oneDNN's GEMM reads them there at about half the rate a plain sum
// of the same bytes does (docs/benchmark.md). So the weights are packed once, at load, into the order the
// kernel reads them, one sequential stream per thread:
//
//   packed[g][p][j][r][t] = w[64 g + 16 j + r][2 p + t]   (g: group of 64 rows, p: pair of columns)
//
// A pair of columns of 16 rows is 64 bytes of bfloat16: one vdpbf16ps against a pair of x's columns, or two
// vectors of float32 (the low halves of its 32-bit words shifted up, the high halves masked). Each lane
// accumulates one output row, so no horizontal sums. Columns are taken in slices that keep a group's slice
// in L1 while every row of x passes over it, so a step of many rows (a prompt chunk) re-reads the weights
// from L1, not from memory.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kGroup = 64;   // output rows a group packs
constexpr int64_t kSlice = 128;  // column pairs per slice: 64 rows x 256 columns x 2 bytes = 32 KiB, L1's size
constexpr int64_t kInt4Columns = 32;  // input columns per d and m: Q4_0 and Q4_1's block

// The rows of x as int4_linear hands them to a level's inner loops (int4_rows): bfloat16 pairs of columns,
// each 32-column block's sum (for the m term), and where the level multiplies in integers (kInt4Integer),
// the rows quantized per block to int8 (q = round(x / scale), scale = the block's largest magnitude / 127)
// with those scales, as llama.cpp's Q8_1 activations.
struct Int4Rows {
  const uint32_t* x;
  const float* xsum;
  const int8_t* xq;
  const float* xscale;
  int64_t pairs, columns;
};

// Calls f(std::integral_constant<int, MR>) for the next MR = min(Max, left) rows of x (Max at most 4).
template <int64_t Max, typename F>
inline void rows(int64_t left, F f) {
  switch (std::min(Max, left)) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

#if defined(__AVX512F__)
// The sums of sixteen vectors' lanes, lane i holding v[i]'s: halves, quarters, pairs, then single lanes
// added across vectors at each step (15 shuffles and adds against 16 separate horizontal sums).
inline __m512 sums16(__m512* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88), _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44), _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
  // Lane 4k + m of z holds v[4m + k]'s sum.
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
}
#endif

}  // namespace

#if defined(__AVX512BF16__)
#include "kernels_bf16.h"
#else
#include "kernels_vec.h"
#endif
namespace {

// x's rows as the tiles read them: a step of up to 16 rows as it is (tiles of that many rows: a decode step
// multiplies only its own rows), more in blocks of 16, the last padded with zero rows into ``padded``.
struct TileRows {
  const uint32_t* x;  // bfloat16 pairs, ``pairs`` a row
  int64_t rows;       // a tile's rows: min(M, 16)
  int64_t total;      // the rows of x the tiles cover: M, or M rounded up to 16
  int64_t count;      // M
  std::vector<uint32_t> padded;

  TileRows(const uint32_t* x_, int64_t M, int64_t pairs) : x(x_), rows(std::min<int64_t>(M, 16)), total(M), count(M) {
    if (M <= 16 || M % 16 == 0) return;
    total = (M + 15) / 16 * 16;
    padded.resize(total * pairs);
    std::memcpy(padded.data(), x_, M * pairs * sizeof(uint32_t));
    x = padded.data();
  }
};

}  // namespace

#if defined(__AMX_BF16__)
#include "kernels_amx.h"
#else
namespace {  // no tiles at this level: the tile paths of linear and int4_linear are never taken
constexpr int64_t kAmxPairs = 16;
inline bool amx_usable() { return false; }
struct Tiles {
  Tiles(bool, int64_t) {}
};
inline void amx_slice(const uint32_t*, int64_t, const c10::BFloat16*, int64_t, float*, bool) {}
inline void amx_int4_half(const TileRows&, int64_t, const float*, int64_t, const uint8_t*, const c10::Half*, float*) {}
}  // namespace
#endif

namespace {

// packed: [groups, pairs, 64, 2] from w [N, K] (bfloat16 or int8); rows past N and the column past an odd K are zeros.
template <typename T>
at::Tensor pack(const at::Tensor& w) {
  const at::Tensor c = w.contiguous();
  const int64_t N = c.size(0), K = c.size(1), groups = (N + kGroup - 1) / kGroup, pairs = (K + 1) / 2;
  at::Tensor packed = at::zeros({groups, pairs, kGroup, 2}, c.options());
  const auto* src = c.const_data_ptr<T>();
  auto* dst = packed.mutable_data_ptr<T>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) dst[(((n / kGroup) * pairs + k / 2) * kGroup + n % kGroup) * 2 + k % 2] = src[n * K + k];
  return packed;
}

at::Tensor bf16_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "bf16_pack: a bfloat16 matrix [N, K]");
  return pack<c10::BFloat16>(w);
}

at::Tensor int8_pack(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "int8_pack: an int8 matrix [N, K]");
  return pack<int8_t>(q);
}

template <typename Out>
void store(Out* y, int64_t ldy, const float* out, int64_t M, int64_t rows, const float* scale, const float* bias) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < rows; ++r)
      y[m * ldy + r] = Out(out[m * kGroup + r] * (scale ? scale[r] : 1.0f) + (bias ? bias[r] : 0.0f));
}

// Group g's sums (``out``: y's M rows x kGroup) into y [M, N] in its dtype, each output row times its scale
// plus its bias (``scale``, ``bias``: N each, or null).
void store_group(const at::Tensor& y, int64_t g, const float* out, const float* scale, const float* bias) {
  const int64_t M = y.size(0), N = y.size(1), n0 = g * kGroup, rows = std::min(kGroup, N - n0);
  const float *sg = scale ? scale + n0 : nullptr, *bg = bias ? bias + n0 : nullptr;
  if (y.scalar_type() == at::kFloat)
    store(y.mutable_data_ptr<float>() + n0, N, out, M, rows, sg, bg);
  else
    store(y.mutable_data_ptr<c10::BFloat16>() + n0, N, out, M, rows, sg, bg);
}

void check_x(const char* name, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat), name,
              ": x is bfloat16 or float32 [M, K]");
}

// The weights of a linear packed by pack<W> (``type``: theirs) for x's K, and float32 scales and bias of N.
void check_packed(const char* name, const at::Tensor& x, const at::Tensor& packed, at::ScalarType type, int64_t N,
                  const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.scalar_type() == type && packed.dim() == 4 && packed.size(2) == kGroup &&
                  packed.size(1) == (x.size(1) + 1) / 2 && packed.size(0) * kGroup >= N && packed.is_contiguous(),
              name, ": the weight must come from its pack, K = x.size(1)");
  for (const auto* v : {&scale, &bias})
    TORCH_CHECK(!*v || ((*v)->scalar_type() == at::kFloat && (*v)->is_contiguous() && (*v)->numel() == N), name,
                ": float32 scales and bias of N");
}

// ``n`` (at most 32) values of x as int8, as llama.cpp's Q8 activations: q = round(v / scale), scale = the
// largest magnitude / 127, which it returns. Rounded to nearest even by adding 1.5 x 2^23 (llama.cpp's
// nearest_int: std::nearbyint's result, in a form the compiler vectorizes; a scalar loop of nearbyint took
// as long as the 64-row int8 product it fed).
inline float quantize_block(const float* v, int64_t n, int8_t* q) {
  float top = 0;
  for (int64_t k = 0; k < n; ++k) top = std::max(top, std::abs(v[k]));
  const float inverse = top > 0 ? 127 / top : 0;
  for (int64_t k = 0; k < n; ++k) {
    const float shifted = v[k] * inverse + 12582912.0f;
    int32_t bits;
    std::memcpy(&bits, &shifted, sizeof bits);
    q[k] = static_cast<int8_t>((bits & 0x007FFFFF) - 0x00400000);
  }
  return top / 127;
}

// x as a level's inner loops take it: bfloat16 as it is; float32 as it is where the level widens to float32
// (kFloatX), else rounded to bfloat16.
at::Tensor level_x(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat && !kFloatX ? x.to(at::kBFloat16) : x;
}

// y = x @ w.T (x scale) (+ bias) over weights W (bfloat16 or int8) packed by pack<W>; x bfloat16 or float32,
// y in x's dtype (float32 too with ``float32``). int8 slices are widened to bfloat16 in registers as they are
// read for a few rows of x, and for more rows (a prompt chunk) once into an L1 buffer that every row then reads.
template <typename W>
at::Tensor linear(const char* name, const at::Tensor& x_, const at::Tensor& packed, int64_t N,
                  const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& bias, bool float32) {
  constexpr bool int8 = std::is_same_v<W, int8_t>;
  check_x(name, x_);
  float32 = float32 || x_.scalar_type() == at::kFloat;
  const at::Tensor x = level_x(x_);
  const bool floats = x.scalar_type() == at::kFloat;
  check_packed(name, x, packed, int8 ? at::kChar : at::kBFloat16, N, scale, bias);
  const int64_t M = x.size(0), K = x.size(1), pairs = packed.size(1), groups = packed.size(0);
  // x's rows contiguous, padded to an even K with a zero column: pairs of columns (a 32-bit word each in bfloat16).
  at::Tensor xs = x;
  if (K % 2 || x.stride(1) != 1 || x.stride(0) != K) {
    xs = at::zeros({M, 2 * pairs}, x.options());
    xs.narrow(1, 0, K).copy_(x);
  }
  at::Tensor y = at::empty({M, N}, x.options().dtype(float32 ? at::kFloat : at::kBFloat16));
  if (M == 0 || N == 0) return y;
  const void* xp = xs.const_data_ptr();
  // AMX's tiles (kernels_amx.h) take x's bfloat16 pairs in blocks of up to 16 rows, by the same packed slices.
  const bool tiles = pairs % kAmxPairs == 0 && amx_usable();
  const TileRows tile_x(static_cast<const uint32_t*>(xp), tiles ? M : 0, pairs);
  const W* w = packed.const_data_ptr<W>();
  const float* sp = scale ? scale->const_data_ptr<float>() : nullptr;
  const float* bp = bias ? bias->const_data_ptr<float>() : nullptr;
  const bool widen = int8 && (M > kRowsPerPass || tiles);
  // Each thread takes a contiguous run of groups, so each streams its share of the weights front to back.
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> out((tiles ? tile_x.total : M) * kGroup);
    std::vector<c10::BFloat16> buffer(widen ? kSlice * kGroup * 2 : 0);
    const Tiles held(tiles, tile_x.rows);
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t p0 = 0; p0 < pairs; p0 += kSlice) {
        const int64_t p1 = std::min(pairs, p0 + kSlice);
        const W* wp = w + (g * pairs + p0) * kGroup * 2;
        const c10::BFloat16* wb = nullptr;
        if constexpr (int8) {
          if (widen) {
            widen_int8(wp, buffer.data(), (p1 - p0) * kGroup * 2);
            wb = buffer.data();
          }
        } else {
          wb = wp;
        }
        if (tiles) {
          for (int64_t m = 0; m < tile_x.total; m += 16)
            amx_slice(tile_x.x + m * pairs + p0, pairs, wb, p1 - p0, out.data() + m * kGroup, p0 == 0);
          continue;
        }
        for (int64_t m = 0; m < M; m += kRowsPerPass) {
          float* om = out.data() + m * kGroup;
          rows<kRowsPerPass>(M - m, [&](auto mr) {
            constexpr int MR = decltype(mr)::value;
            const auto run = [&](const auto* xm) {
              if constexpr (int8) {
                if (!wb) return slice<MR>(xm, pairs, wp, p0, p1, om, p0 == 0);
              }
              slice<MR>(xm, pairs, wb, p0, p1, om, p0 == 0);
            };
            if constexpr (kFloatX) {
              if (floats) return run(static_cast<const float*>(xp) + m * 2 * pairs);
            }
            run(static_cast<const uint32_t*>(xp) + m * pairs);
          });
        }
      }
      store_group(y, g, out.data(), sp, bp);
    }
  });
  return y;
}

// y = x @ w.T (+ bias), bfloat16, or float32 with ``float32`` (logits: the sums are float32 already).
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const std::optional<at::Tensor>& bias,
                       bool float32) {
  return linear<c10::BFloat16>("bf16_linear", x, packed, N, std::nullopt, bias, float32);
}

// y = (x @ q.T) x scale (+ bias), in x's dtype: int8 weights with a float32 scale per output row (weights:
// int8), read from memory at half of bfloat16's bytes. AVX512-BF16 widens them exactly to bfloat16 (in
// registers for a few rows, into L1 once for more) for vdpbf16ps; AVX-512 and AVX2 multiply them in integers
// against x quantized per 32 columns (int8_slice). Measured on the AVX2 EPYC, the 30 layers of SmolLM2-135M:
// see docs/benchmark.md (by CPU kind).
#if defined(__AVX512BF16__)
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t N,
                       const std::optional<at::Tensor>& bias) {
  return linear<int8_t>("int8_linear", x, packed, N, scale, bias, false);
}
#else
at::Tensor int8_linear(const at::Tensor& x_, const at::Tensor& packed, const at::Tensor& scale, int64_t N,
                       const std::optional<at::Tensor>& bias) {
  check_x("int8_linear", x_);
  const at::Tensor x = x_.contiguous();
  check_packed("int8_linear", x, packed, at::kChar, N, scale, bias);
  const int64_t M = x.size(0), K = x.size(1), pairs = packed.size(1), groups = packed.size(0);
  const int64_t blocks = (pairs + kInt8Block - 1) / kInt8Block;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  // Each row quantized per block of 32 columns (the last block may be short; a column past an odd K is 0),
  // its pairs then as 32-bit words of two int16, the form vpmaddwd takes.
  at::Tensor xf = x.to(at::kFloat);
  if (K % 2) xf = at::cat({xf, at::zeros({M, 1}, xf.options())}, 1);
  xf = xf.contiguous();
  std::vector<int32_t> words(M * pairs);
  std::vector<float> xscale(M * blocks);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    int8_t q[2 * kInt8Block];
    for (int64_t m = begin; m < end; ++m)
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t k0 = 2 * kInt8Block * b, n = std::min(2 * kInt8Block, 2 * pairs - k0);
        xscale[m * blocks + b] = quantize_block(xf.const_data_ptr<float>() + m * 2 * pairs + k0, n, q);
        for (int64_t i = 0; i < n / 2; ++i)
          words[m * pairs + k0 / 2 + i] = static_cast<int32_t>(static_cast<uint16_t>(q[2 * i])) |
                                          static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(q[2 * i + 1])) << 16);
      }
  });
  const int8_t* w = packed.const_data_ptr<int8_t>();
  const float* sp = scale.const_data_ptr<float>();
  const float* bp = bias ? bias->const_data_ptr<float>() : nullptr;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> out(M * kGroup);
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t p0 = 0; p0 < pairs; p0 += kSlice) {
        const int64_t p1 = std::min(pairs, p0 + kSlice);
        const int8_t* wp = w + (g * pairs + p0) * kGroup * 2;
        for (int64_t m = 0; m < M; m += kInt8Rows)
          rows<kInt8Rows>(M - m, [&](auto mr) {
            int8_slice<decltype(mr)::value>(words.data() + m * pairs, pairs, xscale.data() + m * blocks, blocks, wp, p0,
                                             p1, out.data() + m * kGroup, p0 == 0);
          });
      }
      store_group(y, g, out.data(), sp, bp);
    }
  });
  return y;
}
#endif

// int4 (weights: int4): Q4_1's arithmetic, w = d q + m, q in [0, 15], d and m float16 per 32 input columns
// of each output row (exactly a GGUF's Q4_0/Q4_1 block values). Packed at load, a group's 64 rows as two
// halves of 32:
//
//   nibbles[g][h][p][b] (a byte): low nibble q[64 g + 32 h + b / 2][2 p + b % 2], high nibble the same 16 rows on
//   scales[g][h][c][s][r] (float16): d (s = 0) or m (s = 1) of row 64 g + 32 h + r over columns 32 c to 32 c + 31
//
// A pair's 32 bytes hold, in their low and high nibbles, 16 rows x a pair of columns each, which every level
// widens exactly in registers (its header says how). A column group's sums of x . q then take d, and m takes
// the group's sum of x (once per row of x): sum_k x_k w_k = d sum_k x_k q_k + m sum_k x_k. Every row of x
// runs the same operations in the same order, so a row's result does not depend on the rows beside it.

// (nibbles, scales) from q [N, K] (int32 in [0, 15]) and d, m [N, K / 32] (float32); rows past N are zeros.
std::tuple<at::Tensor, at::Tensor> int4_pack(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kInt && q.size(1) % kInt4Columns == 0,
              "int4_pack: an int32 matrix [N, K], K a multiple of 32");
  const int64_t N = q.size(0), K = q.size(1), pairs = K / 2, columns = K / kInt4Columns, groups = (N + kGroup - 1) / kGroup;
  for (const auto* s : {&d, &m})
    TORCH_CHECK(s->scalar_type() == at::kFloat && s->size(0) == N && s->size(1) == columns, "int4_pack: float32 d and m [N, K / 32]");
  const at::Tensor qc = q.contiguous(), dc = d.contiguous(), mc = m.contiguous();
  at::Tensor nibbles = at::zeros({groups, 2, pairs, 32}, q.options().dtype(at::kByte));
  at::Tensor scales = at::zeros({groups, 2, columns, 2, 32}, q.options().dtype(at::kHalf));
  const auto* src = qc.const_data_ptr<int32_t>();
  auto* nib = nibbles.mutable_data_ptr<uint8_t>();
  auto* sc = scales.mutable_data_ptr<c10::Half>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t g = n / kGroup, h = n % kGroup / 32, r = n % 32, high = r / 16;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t b = (r % 16) * 2 + k % 2;
      nib[((g * 2 + h) * pairs + k / 2) * 32 + b] |= static_cast<uint8_t>(src[n * K + k] << (4 * high));
    }
    for (int64_t c = 0; c < columns; ++c) {
      sc[(((g * 2 + h) * columns + c) * 2 + 0) * 32 + r] = c10::Half(dc.const_data_ptr<float>()[n * columns + c]);
      sc[(((g * 2 + h) * columns + c) * 2 + 1) * 32 + r] = c10::Half(mc.const_data_ptr<float>()[n * columns + c]);
    }
  }
  return {nibbles, scales};
}

// y = x @ w.T (+ bias), w the int4 weights int4_pack packed; x bfloat16 or float32, y in x's dtype.
at::Tensor int4_linear(const at::Tensor& x_, const at::Tensor& nibbles, const at::Tensor& scales, int64_t N,
                       const std::optional<at::Tensor>& bias) {
  check_x("int4_linear", x_);
  const at::Tensor x = level_x(x_).contiguous();
  const bool floats = x.scalar_type() == at::kFloat;
  const int64_t M = x.size(0), K = x.size(1), pairs = K / 2, columns = K / kInt4Columns, groups = nibbles.size(0);
  TORCH_CHECK(nibbles.scalar_type() == at::kByte && nibbles.dim() == 4 && nibbles.size(2) == pairs &&
                  K % kInt4Columns == 0 && groups * kGroup >= N && nibbles.is_contiguous() &&
                  scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.size(2) == columns,
              "int4_linear: the weights must come from int4_pack, K = x.size(1)");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "int4_linear: a float32 bias of N");
  at::Tensor y = at::empty({M, N}, x_.options());
  if (M == 0 || N == 0) return y;
  // Each row of x's sum over each column block, for the m term; its int8 quantization where the level takes
  // it. In plain buffers, read from x as it is: tensors and a float32 copy of x cost more dispatching than
  // summing (~5 us a call, 120 calls a one-row step of the default model).
  std::vector<float> xsum(M * columns), xscale(kInt4Integer ? M * columns : 0);
  std::vector<int8_t> xq(kInt4Integer ? M * K : 0);
  const float* xf = floats ? x.const_data_ptr<float>() : nullptr;
  const c10::BFloat16* xb = floats ? nullptr : x.const_data_ptr<c10::BFloat16>();
  for (int64_t i = 0; i < M * columns; ++i) {
    float block[kInt4Columns];
    for (int64_t k = 0; k < kInt4Columns; ++k)
      block[k] = floats ? xf[i * kInt4Columns + k] : static_cast<float>(xb[i * kInt4Columns + k]);
    float s = 0;
    for (int64_t k = 0; k < kInt4Columns; ++k) s += block[k];
    xsum[i] = s;
    if constexpr (kInt4Integer) xscale[i] = quantize_block(block, kInt4Columns, xq.data() + i * kInt4Columns);
  }
  // The bfloat16 pairs, for a level that multiplies them (float32 x never reaches one: level_x).
  const Int4Rows rows_of_x{floats ? nullptr : reinterpret_cast<const uint32_t*>(xb), xsum.data(), xq.data(),
                           xscale.data(), pairs, columns};
  const uint8_t* nib = nibbles.const_data_ptr<uint8_t>();
  const c10::Half* sc = scales.const_data_ptr<c10::Half>();
  const float* bp = bias ? bias->const_data_ptr<float>() : nullptr;
  // AMX's tiles where the level has them (x in bfloat16 there: level_x).
  const bool tiles = !floats && amx_usable();
  const TileRows tile_x(rows_of_x.x, tiles ? M : 0, pairs);
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> out((tiles ? tile_x.total : M) * kGroup);
    const Tiles held(tiles, tile_x.rows);
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t h = 0; h < 2; ++h) {
        const uint8_t* half = nib + (g * 2 + h) * pairs * 32;
        const c10::Half* half_scales = sc + (g * 2 + h) * columns * 64;
        if (tiles)
          amx_int4_half(tile_x, pairs, xsum.data(), columns, half, half_scales, out.data() + 32 * h);
        else
          int4_rows(M, rows_of_x, half, half_scales, out.data() + 32 * h);
      }
      store_group(y, g, out.data(), nullptr, bp);
    }
  });
  return y;
}

// Attention over the paged cache, in place: one query token per row, attending to the first lengths[r]
// of its slots[r] (cache slots, position by position): a decode row over its context, or a prompt chunk's
// token over its sequence's slots up to itself (causal); keys and values are read where they
// lie (cache [kv_heads, slots, dim]), never gathered into a tensor of their own. One task per row and KV
// head: its query heads read the same keys and values, still in L1 or L2 after the first.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& slots, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), "paged_attention: shapes");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16, "paged_attention: bfloat16 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention: contiguous caches");
  TORCH_CHECK(slots.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong && slots.dim() == 2 &&
                  slots.size(0) == q.size(0) && lengths.numel() == q.size(0), "paged_attention: slots [rows, columns], lengths [rows]");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(0);
  const int64_t cache_slots = k_cache.size(1), columns = slots.size(1), group = heads / kv_heads;
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(2) == dim, "paged_attention: heads and dim");
  TORCH_CHECK(dim == 64 || dim == 128, "paged_attention: head_dim 64 or 128 (llm/model.py sends no other)");
  // Rows may share one slot table (a prompt chunk's tokens: a stride of 0 between rows).
  const at::Tensor qc = q.contiguous(), sc = slots.stride(1) == 1 ? slots : slots.contiguous(), lc = lengths.contiguous();
  const int64_t row_stride = sc.stride(0);
  at::Tensor out = at::empty_like(qc);
  const auto* qp = qc.const_data_ptr<c10::BFloat16>();
  const auto* kp = k_cache.const_data_ptr<c10::BFloat16>();
  const auto* vp = v_cache.const_data_ptr<c10::BFloat16>();
  const int64_t* sp = sc.const_data_ptr<int64_t>();
  const int64_t* lp = lc.const_data_ptr<int64_t>();
  auto* op = out.mutable_data_ptr<c10::BFloat16>();
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(columns + 16);  // room for a last vector's lanes
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, g = task % kv_heads, length = std::clamp<int64_t>(lp[r], 0, columns);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const int64_t at = (r * heads + h) * dim;
        const c10::BFloat16 *keys = kp + g * cache_slots * dim, *values = vp + g * cache_slots * dim;
        if (dim == 64)
          attend<64>(qp + at, keys, values, sp + r * row_stride, length, float(scale), scores.data(), op + at);
        else
          attend<128>(qp + at, keys, values, sp + r * row_stride, length, float(scale), scores.data(), op + at);
      }
    }
  });
  return out;
}

}  // namespace

// Whether this level's products run on AMX tiles (the AMX level, where Linux lent them): the load log's word.
bool tiles() { return amx_usable(); }

TORCH_LIBRARY(KERNELS_NAMESPACE, m) {
  m.def("tiles() -> bool");
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor lengths, float scale) -> Tensor");
  m.def("bf16_pack(Tensor w) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, int N, Tensor? bias, bool float32=False) -> Tensor");
  m.def("int8_pack(Tensor q) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scale, int N, Tensor? bias) -> Tensor");
  m.def("int4_pack(Tensor q, Tensor d, Tensor m) -> (Tensor, Tensor)");
  m.def("int4_linear(Tensor x, Tensor nibbles, Tensor scales, int N, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(KERNELS_NAMESPACE, CPU, m) {
  m.impl("bf16_pack", &bf16_pack);
  m.impl("bf16_linear", &bf16_linear);
  m.impl("int8_pack", &int8_pack);
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_pack", &int4_pack);
  m.impl("int4_linear", &int4_linear);
  m.impl("paged_attention", &paged_attention);
}

TORCH_LIBRARY_IMPL(KERNELS_NAMESPACE, CompositeExplicitAutograd, m) { m.impl("tiles", &tiles); }
