// The inner loops of llm/kernels.cpp for CPUs without AVX512-BF16: one source, in GCC's vector extensions,
// built as AVX-512 (F, BW, DQ, VL: vectors of 16 float32) and as AVX2 + FMA (vectors of 8). The weights are
// widened to float32 in registers as they are read, exactly: a pair of bfloat16 columns is one 32-bit word
// per row, whose low half shifted up is the first column's float32 and whose high half masked is the
// second's; int8 and int4 go through integer conversion. x's bfloat16 pair is widened the same way and
// broadcast, and an FMA per column adds each product (exact: 8 significant bits times 8) to float32 sums.
// So a step reads the stored bytes (bfloat16's, int8's or int4's), not float32's.
#pragma once

#include <cstring>

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int64_t kRowsPerPass = 4;  // rows of x a pass holds: 4 x 4 accumulators of 32 registers
#else
constexpr int kLanes = 8;
constexpr int64_t kRowsPerPass = 2;  // 2 x 4 accumulators of 16 registers
#endif
// Vectors of output rows a pass holds for MR rows of x: a whole group for one row (independent sums enough to
// hide the FMA's latency, and the group's bytes read in order), else 4 (AVX2: a group in 2 tiles).
template <int MR>
constexpr int kTile = MR == 1 ? kGroup / kLanes : 4;

typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef int32_t vi __attribute__((vector_size(4 * kLanes)));
typedef uint32_t vu __attribute__((vector_size(4 * kLanes)));
typedef int16_t vi16 __attribute__((vector_size(2 * kLanes)));
typedef uint16_t vu16 __attribute__((vector_size(2 * kLanes)));
typedef int8_t vi8 __attribute__((vector_size(kLanes)));

template <typename V>
inline V load(const void* p) {  // unaligned
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void put(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

inline vf splat(float f) { return vf{} + f; }

inline vu widen_u16(const void* p) {  // kLanes 16-bit words zero-extended (vpmovzxwd from memory)
#if defined(__AVX512F__)
  return (vu)_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  return (vu)_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
}

inline float word_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// kLanes rows x a pair of columns (packed order) as two vectors of float32: the first column's and the second's.
inline void widen_pair(const c10::BFloat16* p, vf& first, vf& second) {
  const vu v = load<vu>(p);
  first = (vf)(v << 16);
  second = (vf)(v & 0xFFFF0000u);
}

inline void widen_pair(const int8_t* p, vf& first, vf& second) {
  const vi16 v = load<vi16>(p);
  first = __builtin_convertvector(__builtin_convertvector((vi16)((vu16)v << 8) >> 8, vi), vf);
  second = __builtin_convertvector(__builtin_convertvector(v >> 8, vi), vf);
}

// A slice of packed int8 weights (``count``, a multiple of 32) as bfloat16 in the same order, for the many
// rows of a prompt chunk to read from L1: an integer's float32 has no bits in its low half, so its bfloat16
// is the high half, exactly.
inline void widen_int8(const int8_t* src, c10::BFloat16* dst, int64_t count) {
  for (int64_t i = 0; i < count; i += 16) {
#if defined(__AVX512F__)
    const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(_mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))))), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(bits));
#else
    const auto high = [&](int64_t at) {
      return _mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + at))))), 16);
    };  // packus interleaves the 128-bit halves; the permute puts them back in order
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packus_epi32(high(i), high(i + 8)), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), words);
#endif
  }
}

// out[m][64 rows] (+)= x[m, 2 p0 : 2 p1] . a group's slice of packed weights (``wp``: its pair p0), for MR rows
// of x, a tile of kTile<MR> vectors of output rows at a time.
template <int MR, typename W>
inline void slice(const uint32_t* x, int64_t ldx, const W* wp, int64_t p0, int64_t p1, float* out, bool first) {
  constexpr int T = kTile<MR>;
  for (int64_t tile = 0; tile < kGroup; tile += T * kLanes) {
    vf acc[MR][T];
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < T; ++j) acc[m][j] = first ? vf{} : load<vf>(out + m * kGroup + tile + kLanes * j);
    const W* w = wp + tile * 2;
    for (int64_t p = p0; p < p1; ++p, w += kGroup * 2) {
      float x0[MR], x1[MR];
      for (int m = 0; m < MR; ++m) {
        const uint32_t pair = x[m * ldx + p];
        x0[m] = word_float(pair << 16);
        x1[m] = word_float(pair & 0xFFFF0000u);
      }
      for (int j = 0; j < T; ++j) {
        vf w0, w1;
        widen_pair(w + 2 * kLanes * j, w0, w1);
        for (int m = 0; m < MR; ++m) {
          acc[m][j] = acc[m][j] + w0 * x0[m];
          acc[m][j] = acc[m][j] + w1 * x1[m];
        }
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < T; ++j) put(out + m * kGroup + tile + kLanes * j, acc[m][j]);
  }
}

inline vf half_floats(const c10::Half* p) {  // kLanes float16 as float32 (F16C)
#if defined(__AVX512F__)
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
}

// One int4 pair's 32 bytes, read as kLanes 16-bit words (a row's two columns each), hold rows 0-15 of the
// half in their low nibbles and rows 16-31 in their high ones: four masks and shifts give four vectors.
// (q0, q1: the first column's, q2, q3: the second's.)
inline void int4_widen(const uint8_t* p, vf& q0, vf& q1, vf& q2, vf& q3) {
  const vi v = (vi)widen_u16(p);
  q0 = __builtin_convertvector(v & 15, vf);          // rows 0-15, first column
  q1 = __builtin_convertvector((v >> 4) & 15, vf);   // rows 16-31, first column
  q2 = __builtin_convertvector((v >> 8) & 15, vf);   // rows 0-15, second column
  q3 = __builtin_convertvector(v >> 12, vf);         // rows 16-31, second column
}

// acc[m][32 rows] += d (x . q) + m (sum of x) over one column block, the block's sums ``t`` (first
// column's and second's apart where ``C`` is 2) taken by its d and m.
template <int MR, int V, int C>
inline void int4_fold(vf (&acc)[MR][V], vf (&t)[C][MR][V], const c10::Half* scales, const float* xsum, int64_t ldsum) {
  for (int j = 0; j < V; ++j) {
    const vf d = half_floats(scales + kLanes * j), offset = half_floats(scales + 32 + kLanes * j);
    for (int m = 0; m < MR; ++m) {
      const vf sum = C == 2 ? t[0][m][j] + t[C - 1][m][j] : t[0][m][j];
      acc[m][j] = acc[m][j] + sum * d;
      acc[m][j] = acc[m][j] + offset * xsum[m * ldsum];
    }
  }
}

// For one row of x the first and second columns' products go to separate sums (8 independent chains on
// AVX2, enough to hide the FMA's latency); for more, to the same.
template <int MR>
inline void int4_half(const uint32_t* x, int64_t ldx, const float* xsum, int64_t ldsum, const uint8_t* nibbles,
                      const c10::Half* scales, int64_t pairs, float* out) {
  constexpr int V = 32 / kLanes, low = 16 / kLanes, C = MR == 1 ? 2 : 1;  // vectors of the half; of rows 0-15
  vf acc[MR][V] = {};
  for (int64_t c = 0, p = 0; p < pairs; ++c, scales += 64) {
    vf t[C][MR][V] = {};
    for (const int64_t end = p + kInt4Columns / 2; p < end; ++p, nibbles += 32) {
      float x0[MR], x1[MR];
      for (int m = 0; m < MR; ++m) {
        const uint32_t pair = x[m * ldx + p];
        x0[m] = word_float(pair << 16);
        x1[m] = word_float(pair & 0xFFFF0000u);
      }
      for (int h = 0; h < low; ++h) {
        vf q0, q1, q2, q3;
        int4_widen(nibbles + 2 * kLanes * h, q0, q1, q2, q3);
        for (int m = 0; m < MR; ++m) {
          t[0][m][h] = t[0][m][h] + q0 * x0[m];
          t[0][m][low + h] = t[0][m][low + h] + q1 * x0[m];
          t[C - 1][m][h] = t[C - 1][m][h] + q2 * x1[m];
          t[C - 1][m][low + h] = t[C - 1][m][low + h] + q3 * x1[m];
        }
      }
    }
    int4_fold(acc, t, scales, xsum + c, ldsum);
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < V; ++j) put(out + m * kGroup + kLanes * j, acc[m][j]);
}

// A prompt chunk's many rows: each column block of the half is widened once into float32 in L1 (32 rows x 32
// columns, 4 KiB), and every row's sums then read it there, kRowsPerPass rows at a time.
template <int MR>
inline void int4_block(const uint32_t* x, int64_t ldx, const float* xsum, int64_t ldsum, const float* block,
                       const c10::Half* scales, int64_t p0, float* out, bool first) {
  constexpr int V = 32 / kLanes;
  vf acc[MR][V], t[1][MR][V] = {};
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < V; ++j) acc[m][j] = first ? vf{} : load<vf>(out + m * kGroup + kLanes * j);
  for (int64_t p = 0; p < kInt4Columns / 2; ++p, block += 64) {
    for (int m = 0; m < MR; ++m) {
      const uint32_t pair = x[m * ldx + p0 + p];
      const float x0 = word_float(pair << 16), x1 = word_float(pair & 0xFFFF0000u);
      for (int j = 0; j < V; ++j) {
        t[0][m][j] = t[0][m][j] + load<vf>(block + kLanes * j) * x0;
        t[0][m][j] = t[0][m][j] + load<vf>(block + 32 + kLanes * j) * x1;
      }
    }
  }
  int4_fold(acc, t, scales, xsum, ldsum);
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < V; ++j) put(out + m * kGroup + kLanes * j, acc[m][j]);
}

inline bool int4_many(int64_t M, const uint32_t* x, int64_t ldx, const float* xsum, int64_t ldsum, const uint8_t* nibbles,
                      const c10::Half* scales, int64_t pairs, float* out) {
  if (M <= kRowsPerPass) return false;
  alignas(64) float block[kInt4Columns / 2 * 64];  // [pair][column][32 rows]
  for (int64_t c = 0, p0 = 0; p0 < pairs; ++c, p0 += kInt4Columns / 2, scales += 64) {
    for (int64_t p = 0; p < kInt4Columns / 2; ++p)
      for (int h = 0; h < 16 / kLanes; ++h) {
        vf q0, q1, q2, q3;
        int4_widen(nibbles + (p0 + p) * 32 + 2 * kLanes * h, q0, q1, q2, q3);
        float* at = block + p * 64 + kLanes * h;
        put(at, q0), put(at + 16, q1), put(at + 32, q2), put(at + 48, q3);
      }
    for (int64_t m = 0; m < M; m += kRowsPerPass)
      rows<kRowsPerPass>(M - m, [&](auto mr) {
        int4_block<decltype(mr)::value>(x + m * ldx, ldx, xsum + m * ldsum + c, ldsum, block, scales, p0,
                                        out + m * kGroup, c == 0);
      });
  }
  return true;
}

inline vf widen(const c10::BFloat16* p) {  // kLanes bfloat16 as float32
  return (vf)(__builtin_convertvector(load<vu16>(p), vu) << 16);
}

inline float lanes_sum(vf v) {
  float s = 0;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// The sums of kLanes vectors' lanes, lane i holding v[i]'s.
inline vf sums(vf* v) {
#if defined(__AVX512F__)
  return (vf)sums16(reinterpret_cast<__m512*>(v));
#else
  __m256 h[4];
  for (int i = 0; i < 4; ++i) h[i] = _mm256_hadd_ps((__m256)v[2 * i], (__m256)v[2 * i + 1]);
  const __m256 a = _mm256_hadd_ps(h[0], h[1]), b = _mm256_hadd_ps(h[2], h[3]);  // 128-bit halves apart
  return (vf)_mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
#endif
}

// e^x for x <= 0, as kernels_bf16.h's exp_nonpositive: x = n ln 2 + r, e^r by its polynomial to r^7, 2^n put in
// the exponent (n >= -126 for x >= -87: a normal float).
inline vf exp_nonpositive(vf x) {
  x = x > splat(-87.0f) ? x : splat(-87.0f);
  const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // rounded to an integer: 1.5 x 2^23
  const vf r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  vf p = splat(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = p * r + c;
  return p * (vf)((__builtin_convertvector(n, vi) + 127) << 23);
}

// One query head over one row's keys and values, DIM wide, read in place through the row's slots: scores
// summed kLanes keys at a time across lanes, a float32 softmax, then the values summed in registers.
// ``scores`` has room for kLanes past ``length``.
template <int DIM>
void attend(const c10::BFloat16* query, const c10::BFloat16* keys, const c10::BFloat16* values, const int64_t* slots,
            int64_t length, float scale, float* scores, c10::BFloat16* out) {
  constexpr int V = DIM / kLanes;
  vf q[V];
  for (int i = 0; i < V; ++i) q[i] = widen(query + kLanes * i);
  auto dot = [&](int64_t p) {
    const c10::BFloat16* key = keys + slots[p] * DIM;
    vf acc = q[0] * widen(key);
    for (int i = 1; i < V; ++i) acc = acc + q[i] * widen(key + kLanes * i);
    return acc;
  };
  vf tops = splat(-INFINITY);
  int64_t p = 0;
  for (; p + kLanes <= length; p += kLanes) {
    vf v[kLanes];
    for (int i = 0; i < kLanes; ++i) v[i] = dot(p + i);
    const vf s = sums(v) * scale;
    put(scores + p, s);
    tops = tops > s ? tops : s;
  }
  float top = -INFINITY;
  for (int i = 0; i < kLanes; ++i) top = std::max(top, tops[i]);
  for (; p < length; ++p) {
    scores[p] = lanes_sum(dot(p)) * scale;
    top = std::max(top, scores[p]);
  }
  vf total = {};
  for (p = 0; p + kLanes <= length; p += kLanes) {
    const vf e = exp_nonpositive(load<vf>(scores + p) - top);
    put(scores + p, e);
    total = total + e;
  }
  if (p < length) {  // the tail's lanes past length are computed, stored in the room past it, and not summed
    const vf e = exp_nonpositive(load<vf>(scores + p) - top);
    put(scores + p, e);
    for (int i = 0; p + i < length; ++i) total[i] += e[i];
  }
  const float sum = lanes_sum(total);
  vf acc[V] = {};
  for (p = 0; p < length; ++p) {
    const c10::BFloat16* value = values + slots[p] * DIM;
    for (int i = 0; i < V; ++i) acc[i] = acc[i] + widen(value + kLanes * i) * scores[p];
  }
  const float inverse = length ? 1.0f / sum : 0.0f;
  for (int i = 0; i < V; ++i)
    for (int l = 0; l < kLanes; ++l) out[kLanes * i + l] = c10::BFloat16(acc[i][l] * inverse);
}

}  // namespace
