// CPU kernels of our own, built by llm/kernels.py for the CPU it runs on (it says why and when).
//
// A bfloat16 linear layer, y = x @ w.T (+ bias), for CPUs with AVX512-BF16. A decode step multiplies a
// row or a few by each weight, so it is bound by reading the weights once, and oneDNN's GEMM reads them
// there at about half the rate a plain sum of the same bytes does (docs/benchmark.md). So the weights are
// packed once, at load, into the order the kernel reads them, one sequential stream per thread:
//
//   packed[g][p][j][r][t] = w[64 g + 16 j + r][2 p + t]   (g: group of 64 rows, p: pair of columns)
//
// One vdpbf16ps then takes 64 bytes of weights (16 rows x one pair of columns) against a pair of x's
// columns broadcast to every lane: each lane accumulates one output row, so no horizontal sums. Four
// such vectors (a group's 64 rows) are dotted with up to four rows of x, sixteen accumulators in
// registers. Columns are taken in slices that keep a group's slice in L1 while every row of x passes
// over it, so a step of many rows (a prompt chunk) re-reads the weights from L1, not from memory.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
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
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kGroup = 64;   // output rows a group packs: four vectors of sixteen lanes
constexpr int64_t kSlice = 128;  // column pairs per slice: 64 rows x 256 columns x 2 bytes = 32 KiB, L1's size
constexpr int64_t kRowsPerPass = 4;

// 32 int8 weights (16 rows x a pair of columns, packed order) as bfloat16, exactly: |q| <= 127 fits its 8 bits.
inline __m512bh widen_int8(const int8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// 32 weights (16 rows x a pair of columns, packed order) as bfloat16: where they lie, or widened from int8
// in registers as they are read (for a few rows of x, cheaper than widening into L1 and reading back).
inline __m512bh weights32(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh weights32(const int8_t* p) { return widen_int8(p); }

// acc[m][j] (+)= x[m, 2 p0 : 2 p1] . a group's slice of packed weights (``wp``: its pair p0), for MR rows of x.
template <int MR, typename W>
inline void slice(const uint32_t* x, int64_t ldx, const W* wp, int64_t p0, int64_t p1, float* out, bool first) {
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + m * kGroup + 16 * j);
  for (int64_t p = p0; p < p1; ++p, wp += kGroup * 2) {
    const __m512bh w0 = weights32(wp), w1 = weights32(wp + 32), w2 = weights32(wp + 64), w3 = weights32(wp + 96);
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * ldx + p]));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xv, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xv, w1);
      acc[m][2] = _mm512_dpbf16_ps(acc[m][2], xv, w2);
      acc[m][3] = _mm512_dpbf16_ps(acc[m][3], xv, w3);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + m * kGroup + 16 * j, acc[m][j]);
}

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

// Calls f(std::integral_constant<int, MR>) for the next MR = min(4, left) rows of x.
template <typename F>
inline void rows(int64_t left, F f) {
  switch (std::min(kRowsPerPass, left)) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

// y = x @ w.T (x scale) (+ bias) over weights W (bfloat16 or int8) packed by pack<W>. int8 slices are
// widened to bfloat16 in registers as they are read for a few rows of x, and for more rows (a prompt
// chunk) once into an L1 buffer that every row then reads.
template <typename W>
at::Tensor linear(const char* name, const at::Tensor& x, const at::Tensor& packed, int64_t N,
                  const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& bias, bool float32) {
  constexpr bool int8 = std::is_same_v<W, int8_t>;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, name, ": x is bfloat16 [M, K]");
  TORCH_CHECK(packed.scalar_type() == (int8 ? at::kChar : at::kBFloat16) && packed.dim() == 4 &&
                  packed.size(2) == kGroup && packed.size(1) == (x.size(1) + 1) / 2 && packed.size(0) * kGroup >= N &&
                  packed.is_contiguous(),
              name, ": the weight must come from its pack, K = x.size(1)");
  for (const auto* v : {&scale, &bias})
    TORCH_CHECK(!*v || ((*v)->scalar_type() == at::kFloat && (*v)->is_contiguous() && (*v)->numel() == N), name,
                ": float32 scales and bias of N");
  const int64_t M = x.size(0), K = x.size(1), pairs = packed.size(1), groups = packed.size(0);
  // x's rows as pairs of columns (one 32-bit word each), padded to an even K with a zero column.
  at::Tensor xs = x;
  if (K % 2 || x.stride(1) != 1 || x.stride(0) != K) {
    xs = at::zeros({M, 2 * pairs}, x.options());
    xs.narrow(1, 0, K).copy_(x);
  }
  at::Tensor y = at::empty({M, N}, x.options().dtype(float32 ? at::kFloat : at::kBFloat16));
  if (M == 0 || N == 0) return y;
  const auto* xp = reinterpret_cast<const uint32_t*>(xs.const_data_ptr<c10::BFloat16>());
  const W* w = packed.const_data_ptr<W>();
  const float* sp = scale ? scale->const_data_ptr<float>() : nullptr;
  const float* bp = bias ? bias->const_data_ptr<float>() : nullptr;
  const bool widen = int8 && M > kRowsPerPass;
  // Each thread takes a contiguous run of groups, so each streams its share of the weights front to back.
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> out(M * kGroup);
    std::vector<c10::BFloat16> buffer(widen ? kSlice * kGroup * 2 : 0);
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t p0 = 0; p0 < pairs; p0 += kSlice) {
        const int64_t p1 = std::min(pairs, p0 + kSlice);
        const W* wp = w + (g * pairs + p0) * kGroup * 2;
        const c10::BFloat16* wb = nullptr;
        if constexpr (int8) {
          if (widen) {
            for (int64_t i = 0; i < (p1 - p0) * kGroup * 2; i += 32)
              _mm512_storeu_si512(buffer.data() + i, (__m512i)widen_int8(wp + i));
            wb = buffer.data();
          }
        } else {
          wb = wp;
        }
        for (int64_t m = 0; m < M; m += kRowsPerPass) {
          const uint32_t* xm = xp + m * pairs;
          float* om = out.data() + m * kGroup;
          rows(M - m, [&](auto mr) {
            constexpr int MR = decltype(mr)::value;
            if constexpr (int8) {
              if (!wb) return slice<MR>(xm, pairs, wp, p0, p1, om, p0 == 0);
            }
            slice<MR>(xm, pairs, wb, p0, p1, om, p0 == 0);
          });
        }
      }
      const int64_t n0 = g * kGroup, rows_here = std::min(kGroup, N - n0);
      const float *sg = sp ? sp + n0 : nullptr, *bg = bp ? bp + n0 : nullptr;
      if (float32)
        store(y.mutable_data_ptr<float>() + n0, N, out.data(), M, rows_here, sg, bg);
      else
        store(y.mutable_data_ptr<c10::BFloat16>() + n0, N, out.data(), M, rows_here, sg, bg);
    }
  });
  return y;
}

// y = x @ w.T (+ bias), bfloat16, or float32 with ``float32`` (logits: the sums are float32 already).
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const std::optional<at::Tensor>& bias,
                       bool float32) {
  return linear<c10::BFloat16>("bf16_linear", x, packed, N, std::nullopt, bias, float32);
}

// y = (x @ q.T) x scale (+ bias), bfloat16: int8 weights with a float32 scale per output row (weights: int8).
// The int8 weights are read from memory, half of bfloat16's bytes, and widened exactly in L1.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t N,
                       const std::optional<at::Tensor>& bias) {
  return linear<int8_t>("int8_linear", x, packed, N, scale, bias, false);
}

// int4 (weights: int4): Q4_1's arithmetic, w = d q + m, q in [0, 15], d and m float16 per 32 input columns
// of each output row (exactly a GGUF's Q4_0/Q4_1 block values). Packed at load, a group's 64 rows as two
// halves of 32:
//
//   nibbles[g][h][p][b] (a byte): low nibble q[64 g + 32 h + b / 2][2 p + b % 2], high nibble the same 16 rows on
//   scales[g][h][c][s][r] (float16): d (s = 0) or m (s = 1) of row 64 g + 32 h + r over columns 32 c to 32 c + 31
//
// One 32-byte load widened to 16-bit lanes holds, in its low and high nibbles, two vectors of 16 rows x a
// pair of columns; a 32-entry table (vpermw, which reads an index's low 5 bits) turns each into bfloat16,
// exactly. A column group's sums of x . q then take d, and m takes the group's sum of x (once per row of x):
// sum_k x_k w_k = d sum_k x_k q_k + m sum_k x_k. Every row of x runs the same operations in the same order,
// so a row's result does not depend on the rows beside it.
constexpr int64_t kInt4Columns = 32;  // input columns per d and m: Q4_0 and Q4_1's block

template <int MR>
inline void int4_half(const uint32_t* x, int64_t ldx, const float* xsum, int64_t ldsum, const uint8_t* nibbles,
                      const c10::Half* scales, int64_t pairs, float* out) {
  alignas(64) static const uint16_t kTable[32] = {  // bfloat16 of i % 16
      0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
      0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
  const __m512i table = _mm512_load_si512(kTable);
  const auto half16 = [](const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); };
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t c = 0, p = 0; p < pairs; ++c, scales += 64) {
    __m512 t[MR][2];
    for (int m = 0; m < MR; ++m) t[m][0] = t[m][1] = _mm512_setzero_ps();
    for (const int64_t end = p + kInt4Columns / 2; p < end; ++p, nibbles += 32) {
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles)));
      const __m512bh w0 = (__m512bh)_mm512_permutexvar_epi16(v, table);
      const __m512bh w1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
      for (int m = 0; m < MR; ++m) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * ldx + p]));
        t[m][0] = _mm512_dpbf16_ps(t[m][0], xv, w0);
        t[m][1] = _mm512_dpbf16_ps(t[m][1], xv, w1);
      }
    }
    const __m512 d0 = half16(scales), d1 = half16(scales + 16), m0 = half16(scales + 32), m1 = half16(scales + 48);
    for (int m = 0; m < MR; ++m) {
      const __m512 s = _mm512_set1_ps(xsum[m * ldsum + c]);
      acc[m][0] = _mm512_fmadd_ps(m0, s, _mm512_fmadd_ps(t[m][0], d0, acc[m][0]));
      acc[m][1] = _mm512_fmadd_ps(m1, s, _mm512_fmadd_ps(t[m][1], d1, acc[m][1]));
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm512_storeu_ps(out + m * kGroup, acc[m][0]);
    _mm512_storeu_ps(out + m * kGroup + 16, acc[m][1]);
  }
}

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

// y = x @ w.T (+ bias), bfloat16, w the int4 weights int4_pack packed.
at::Tensor int4_linear(const at::Tensor& x_, const at::Tensor& nibbles, const at::Tensor& scales, int64_t N,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_.dim() == 2 && x_.scalar_type() == at::kBFloat16, "int4_linear: x is bfloat16 [M, K]");
  const at::Tensor x = x_.contiguous();
  const int64_t M = x.size(0), K = x.size(1), pairs = K / 2, columns = K / kInt4Columns, groups = nibbles.size(0);
  TORCH_CHECK(nibbles.scalar_type() == at::kByte && nibbles.dim() == 4 && nibbles.size(2) == pairs &&
                  K % kInt4Columns == 0 && groups * kGroup >= N && nibbles.is_contiguous() &&
                  scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.size(2) == columns,
              "int4_linear: the weights must come from int4_pack, K = x.size(1)");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "int4_linear: a float32 bias of N");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  // Each row of x's sum over each column group, for the m term.
  at::Tensor xsum = at::empty({M, columns}, x.options().dtype(at::kFloat));
  const auto* xv = x.const_data_ptr<c10::BFloat16>();
  float* sp = xsum.mutable_data_ptr<float>();
  for (int64_t i = 0; i < M * columns; ++i) {
    float s = 0;
    for (int64_t k = 0; k < kInt4Columns; ++k) s += static_cast<float>(xv[i * kInt4Columns + k]);
    sp[i] = s;
  }
  const auto* xp = reinterpret_cast<const uint32_t*>(xv);
  const uint8_t* nib = nibbles.const_data_ptr<uint8_t>();
  const c10::Half* sc = scales.const_data_ptr<c10::Half>();
  const float* bp = bias ? bias->const_data_ptr<float>() : nullptr;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> out(M * kGroup);
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t m = 0; m < M; m += kRowsPerPass)
          rows(M - m, [&](auto mr) {
            int4_half<decltype(mr)::value>(xp + m * pairs, pairs, sp + m * columns, columns,
                                           nib + (g * 2 + h) * pairs * 32, sc + (g * 2 + h) * columns * 64, pairs,
                                           out.data() + m * kGroup + 32 * h);
          });
      const int64_t n0 = g * kGroup;
      store(y.mutable_data_ptr<c10::BFloat16>() + n0, N, out.data(), M, std::min(kGroup, N - n0), nullptr,
            bp ? bp + n0 : nullptr);
    }
  });
  return y;
}

inline __m512 widen(const c10::BFloat16* p) {  // 16 bfloat16 as float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

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

// e^x for x <= 0 (scores less their maximum), sixteen at a time: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by
// its Taylor polynomial to r^7 (relative error under 2e-7, below float32's rounding of the sum), 2^n put
// in the exponent; x is taken no lower than -87 (e^-87, about 1.6e-38: nothing beside the maximum's 1).
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  const __m512 rr = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);  // p x 2^n
}

// One query head over one row's keys and values, DIM wide (a multiple of 32), read in place through
// the row's slots: scores by vdpbf16ps, a float32 softmax, then the values summed in registers.
template <int DIM>
void attend(const c10::BFloat16* query, const c10::BFloat16* keys, const c10::BFloat16* values, const int64_t* slots,
            int64_t length, float scale, float* scores, c10::BFloat16* out) {
  __m512bh q[DIM / 32];
  for (int i = 0; i < DIM / 32; ++i) q[i] = (__m512bh)_mm512_loadu_si512(query + 32 * i);
  auto dot = [&](int64_t p) {
    const c10::BFloat16* key = keys + slots[p] * DIM;
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < DIM / 32; ++i) acc = _mm512_dpbf16_ps(acc, q[i], (__m512bh)_mm512_loadu_si512(key + 32 * i));
    return acc;
  };
  const __m512 scale16 = _mm512_set1_ps(scale);
  __m512 top16 = _mm512_set1_ps(-INFINITY);
  int64_t p = 0;
  for (; p + 16 <= length; p += 16) {  // sixteen dots summed across lanes together
    __m512 v[16];
    for (int i = 0; i < 16; ++i) v[i] = dot(p + i);
    const __m512 s = _mm512_mul_ps(sums16(v), scale16);
    _mm512_storeu_ps(scores + p, s);
    top16 = _mm512_max_ps(top16, s);
  }
  float top = _mm512_reduce_max_ps(top16);
  for (; p < length; ++p) {
    scores[p] = _mm512_reduce_add_ps(dot(p)) * scale;
    top = std::max(top, scores[p]);
  }
  const __m512 top16s = _mm512_set1_ps(top);
  __m512 sum16 = _mm512_setzero_ps();
  for (int64_t p = 0; p < length; p += 16) {  // the tail masked: its lanes load and store nothing
    const __mmask16 lanes = length - p >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (length - p)) - 1);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, scores + p), top16s));
    _mm512_mask_storeu_ps(scores + p, lanes, e);
    sum16 = _mm512_add_ps(sum16, _mm512_maskz_mov_ps(lanes, e));
  }
  const float sum = _mm512_reduce_add_ps(sum16);
  __m512 acc[DIM / 16];
  for (int i = 0; i < DIM / 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < length; ++p) {
    const c10::BFloat16* value = values + slots[p] * DIM;
    const __m512 weight = _mm512_set1_ps(scores[p]);
    for (int i = 0; i < DIM / 16; ++i) acc[i] = _mm512_fmadd_ps(weight, widen(value + 16 * i), acc[i]);
  }
  alignas(64) float result[DIM];
  const __m512 inverse = _mm512_set1_ps(length ? 1.0f / sum : 0.0f);
  for (int i = 0; i < DIM / 16; ++i) _mm512_store_ps(result + 16 * i, _mm512_mul_ps(acc[i], inverse));
  for (int i = 0; i < DIM; ++i) out[i] = c10::BFloat16(result[i]);
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
    std::vector<float> scores(columns);
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

TORCH_LIBRARY(triton_chat_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor lengths, float scale) -> Tensor");
  m.def("bf16_pack(Tensor w) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, int N, Tensor? bias, bool float32=False) -> Tensor");
  m.def("int8_pack(Tensor q) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scale, int N, Tensor? bias) -> Tensor");
  m.def("int4_pack(Tensor q, Tensor d, Tensor m) -> (Tensor, Tensor)");
  m.def("int4_linear(Tensor x, Tensor nibbles, Tensor scales, int N, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(triton_chat_cpu, CPU, m) {
  m.impl("bf16_pack", &bf16_pack);
  m.impl("bf16_linear", &bf16_linear);
  m.impl("int8_pack", &int8_pack);
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_pack", &int4_pack);
  m.impl("int4_linear", &int4_linear);
  m.impl("paged_attention", &paged_attention);
}
