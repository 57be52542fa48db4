// The inner loops of llm/kernels.cpp for CPUs with AVX512-BF16: vdpbf16ps takes 64 bytes of weights (16 rows x
// one pair of columns, bfloat16) against a pair of x's columns broadcast to every lane. Four such vectors (a
// group's 64 rows) are dotted with up to four rows of x, sixteen accumulators in registers. int8 and int4
// weights are widened exactly to bfloat16 in registers as they are read.
#pragma once

namespace {

constexpr int64_t kRowsPerPass = 4;
constexpr bool kInt4Integer = false;  // int4 multiplies bfloat16 x by its widened weights
constexpr bool kFloatX = false;  // vdpbf16ps multiplies bfloat16: float32 x is rounded to it first (as llama.cpp)

// 32 int8 weights (16 rows x a pair of columns, packed order) as bfloat16, exactly: |q| <= 127 fits its 8 bits.
inline __m512bh widen_int8(const int8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// A slice of packed int8 weights (``count``, a multiple of 32) as bfloat16 in the same order, for the many
// rows of a prompt chunk to read from L1.
inline void widen_int8(const int8_t* src, c10::BFloat16* dst, int64_t count) {
  for (int64_t i = 0; i < count; i += 32) _mm512_storeu_si512(dst + i, (__m512i)widen_int8(src + i));
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

// bfloat16 of i % 16, for vpermw on a nibble's 16-bit lane (it reads the index's low 5 bits).
alignas(64) constexpr uint16_t kNibbles[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

// 16 float16 (int4's d or m of 16 rows) as float32.
inline __m512 half16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// One int4 pair's 32 bytes, widened to 16-bit lanes, hold in their low and high nibbles two vectors of 16
// rows x a pair of columns; a 32-entry table (vpermw, which reads an index's low 5 bits) turns each into
// bfloat16, exactly.
template <int MR>
inline void int4_half(const uint32_t* x, int64_t ldx, const float* xsum, int64_t ldsum, const uint8_t* nibbles,
                      const c10::Half* scales, int64_t pairs, float* out) {
  const __m512i table = _mm512_load_si512(kNibbles);
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

// out[m][the half's 32 rows] for every row of x, kRowsPerPass at a time.
inline void int4_rows(int64_t M, const Int4Rows& x, const uint8_t* nibbles, const c10::Half* scales, float* out) {
  for (int64_t m = 0; m < M; m += kRowsPerPass)
    rows<kRowsPerPass>(M - m, [&](auto mr) {
      int4_half<decltype(mr)::value>(x.x + m * x.pairs, x.pairs, x.xsum + m * x.columns, x.columns, nibbles, scales,
                                     x.pairs, out + m * kGroup);
    });
}

inline __m512 widen(const c10::BFloat16* p) {  // 16 bfloat16 as float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
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

}  // namespace
