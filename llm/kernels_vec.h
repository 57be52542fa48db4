// The inner loops of llm/kernels.cpp for CPUs without AVX512-BF16: one source, in GCC's vector extensions,
// built as AVX-512 (F, BW, DQ, VL: vectors of 16 float32) and as AVX2 + FMA (vectors of 8). bfloat16 weights
// are widened to float32 in registers as they are read, exactly: a pair of bfloat16 columns is one 32-bit
// word per row, whose low half shifted up is the first column's float32 and whose high half masked is the
// second's. x's pair (float32, or bfloat16 widened the same way) is broadcast, and an FMA per column adds each
// product to float32 sums. int8 and int4 are multiplied in integers against x quantized per 32 columns to
// int8 (int8_slice, int4_rows below), as llama.cpp's Q8_0 and Q4_1 x Q8 dot products. So a step reads the
// stored bytes (bfloat16's, int8's or int4's), not float32's.
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
typedef uint16_t vu16 __attribute__((vector_size(2 * kLanes)));

template <typename V>
inline V load(const void* p) {  // unaligned
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void put(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

inline vf splat(float f) { return vf{} + f; }

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

// Columns 2 at and 2 at + 1 of x as float32: from a bfloat16 pair (one 32-bit word), widened exactly, or as
// they are (float32 activations: the model's dtype where weights are stored in bfloat16, weights: auto).
constexpr bool kFloatX = true;
inline void x_pair(const uint32_t* x, int64_t at, float& first, float& second) {
  first = word_float(x[at] << 16);
  second = word_float(x[at] & 0xFFFF0000u);
}
inline void x_pair(const float* x, int64_t at, float& first, float& second) {
  first = x[2 * at];
  second = x[2 * at + 1];
}

// out[m][64 rows] (+)= x[m, 2 p0 : 2 p1] . a group's slice of packed weights (``wp``: its pair p0), for MR rows
// of x (``ldx`` pairs of columns apart), a tile of kTile<MR> vectors of output rows at a time.
template <int MR, typename W, typename X>
inline void slice(const X* x, int64_t ldx, const W* wp, int64_t p0, int64_t p1, float* out, bool first) {
  constexpr int T = kTile<MR>;
  for (int64_t tile = 0; tile < kGroup; tile += T * kLanes) {
    vf acc[MR][T];
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < T; ++j) acc[m][j] = first ? vf{} : load<vf>(out + m * kGroup + tile + kLanes * j);
    const W* w = wp + tile * 2;
    for (int64_t p = p0; p < p1; ++p, w += kGroup * 2) {
      float x0[MR], x1[MR];
      for (int m = 0; m < MR; ++m) x_pair(x, m * ldx + p, x0[m], x1[m]);
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

// int4 in integers, as llama.cpp's Q4_1 x Q8_1 dot product: each row of x quantized per 32-column block to
// int8 (Int4Rows), vpmaddubsw multiplies a pair's nibbles (unsigned bytes, one row's two columns side by side)
// by the pair of x's int8 (the same two bytes in every 16-bit lane) and adds the two products: one 16-bit
// lane per output row. Eight pairs' sums fit 16 bits (8 x 2 x 15 x 127 = 30480), so a block of sixteen is
// summed in two halves widened to 32 bits; the block's sum then takes d x x's scale, and m takes the block's
// sum of x (exact, from bfloat16). The weights' bytes are read once for kInt4Rows rows of x.
#if defined(__AVX512F__)
typedef __m512i vbytes;  // one pair of the half's 32 rows: rows 0-15 in the low 32 bytes, 16-31 in the high
constexpr int kByteVectors = 1;
inline void int4_bytes(const uint8_t* p, vbytes (&q)[kByteVectors]) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), low = _mm256_set1_epi8(15);
  q[0] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(b, low)),
                            _mm256_and_si256(_mm256_srli_epi16(b, 4), low), 1);
}
inline vbytes pair_words(int16_t pair) { return _mm512_set1_epi16(pair); }
inline vbytes pair_sums(vbytes sums, vbytes q, vbytes x) { return _mm512_add_epi16(sums, _mm512_maddubs_epi16(q, x)); }
inline vi words_low(vbytes s) { return (vi)_mm512_cvtepi16_epi32(_mm512_castsi512_si256(s)); }
inline vi words_high(vbytes s) { return (vi)_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(s, 1)); }
constexpr int kInt4Rows = 4;
#else
typedef __m256i vbytes;  // one pair of 16 rows: rows 0-15 (q[0]) or 16-31 (q[1])
constexpr int kByteVectors = 2;
inline void int4_bytes(const uint8_t* p, vbytes (&q)[kByteVectors]) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), low = _mm256_set1_epi8(15);
  q[0] = _mm256_and_si256(b, low);
  q[1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
}
inline vbytes pair_words(int16_t pair) { return _mm256_set1_epi16(pair); }
inline vbytes pair_sums(vbytes sums, vbytes q, vbytes x) { return _mm256_add_epi16(sums, _mm256_maddubs_epi16(q, x)); }
inline vi words_low(vbytes s) { return (vi)_mm256_cvtepi16_epi32(_mm256_castsi256_si128(s)); }
inline vi words_high(vbytes s) { return (vi)_mm256_cvtepi16_epi32(_mm256_extracti128_si256(s, 1)); }
constexpr int kInt4Rows = 4;  // 4 x 2 sums of 16 bits and 4 pairs of x of 16 registers
#endif
constexpr bool kInt4Integer = true;

// out[m][the half's 32 rows] (+)= block c's d (q . xq) x's scale + m (sum of x), for MR rows of x.
template <int MR>
inline void int4_block(const Int4Rows& x, int64_t c, const uint8_t* nibbles, const c10::Half* scales, float* out) {
  constexpr int V = 32 / kLanes;
  const int16_t* xq = reinterpret_cast<const int16_t*>(x.xq);  // a pair of int8 columns as one 16-bit word
  vi block[MR][V] = {};
  for (int64_t half = 0; half < 2; ++half) {
    vbytes sums[MR][kByteVectors];
    for (int m = 0; m < MR; ++m)
      for (int b = 0; b < kByteVectors; ++b) sums[m][b] = vbytes{};
    for (int64_t p = c * 16 + half * 8, end = p + 8; p < end; ++p) {
      vbytes q[kByteVectors];
      int4_bytes(nibbles + p * 32, q);
      for (int m = 0; m < MR; ++m) {
        const vbytes pair = pair_words(xq[m * x.pairs + p]);
        for (int b = 0; b < kByteVectors; ++b) sums[m][b] = pair_sums(sums[m][b], q[b], pair);
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int b = 0; b < kByteVectors; ++b) {
        block[m][2 * b] += words_low(sums[m][b]);
        block[m][2 * b + 1] += words_high(sums[m][b]);
      }
  }
  for (int j = 0; j < V; ++j) {
    const vf d = half_floats(scales + c * 64 + kLanes * j), offset = half_floats(scales + c * 64 + 32 + kLanes * j);
    for (int m = 0; m < MR; ++m) {
      vf acc = c == 0 ? vf{} : load<vf>(out + m * kGroup + kLanes * j);
      acc = acc + __builtin_convertvector(block[m][j], vf) * (d * x.xscale[m * x.columns + c]);
      acc = acc + offset * x.xsum[m * x.columns + c];
      put(out + m * kGroup + kLanes * j, acc);
    }
  }
}

// out[m][the half's 32 rows] for every row of x, kInt4Rows at a time, block by block.
inline void int4_rows(int64_t M, const Int4Rows& x, const uint8_t* nibbles, const c10::Half* scales, float* out) {
  for (int64_t m = 0; m < M; m += kInt4Rows) {
    const Int4Rows at{x.x, x.xsum + m * x.columns, x.xq + m * 2 * x.pairs, x.xscale + m * x.columns, x.pairs, x.columns};
    for (int64_t c = 0; c < x.columns; ++c)
      rows<kInt4Rows>(M - m, [&](auto mr) { int4_block<decltype(mr)::value>(at, c, nibbles, scales, out + m * kGroup); });
  }
}

// int8 in integers, as llama.cpp's Q8_0 x Q8_0 dot product: each row of x quantized per 32-column block to
// int8 (int8_linear), a pair of its columns as one 32-bit word of two int16 broadcast to every lane. A pair
// of kLanes rows' int8 (packed order: one row's two columns side by side) sign-extends to int16 (vpmovsxbw),
// and vpmaddwd multiplies each row's two by x's two and adds them: one int32 lane per output row, exact. A
// block's 16 pairs sum in int32 (at most 32 x 127 x 127), then take x's scale in float32; the row's own
// scale comes at the store. Per pair a row of x costs one multiply-add and one add per kLanes rows, and the
// widening (one instruction) is shared by every row of x in the pass.
typedef int8_t vb __attribute__((vector_size(2 * kLanes)));   // kLanes rows x a pair of columns
typedef int16_t vw __attribute__((vector_size(4 * kLanes)));  // the same, sign-extended
constexpr int64_t kInt8Block = 16;  // pairs of columns per scale of x: 32 columns
constexpr int64_t kInt8Rows = 4;    // rows of x a pass holds: their sums of a tile in registers, no float sums
// Vectors of output rows a pass holds: a whole group for one row, else MR x T int32 sums, T pairs of weights
// and x's word within the registers (AVX2: 4 x 2 + 2 + 1 of 16; AVX-512: 4 x 4 + 4 + 1 of 32).
template <int MR>
constexpr int kInt8Tile = MR == 1 || kLanes == 16 ? kGroup / kLanes : 2;

inline vi pair_dot(vw w, int32_t x) {
#if defined(__AVX512F__)
  return (vi)_mm512_madd_epi16((__m512i)w, _mm512_set1_epi32(x));
#else
  return (vi)_mm256_madd_epi16((__m256i)w, _mm256_set1_epi32(x));
#endif
}

// out[m][64 rows] (+)= x[m] . a group's slice of packed int8 weights (``wp``: its pair p0, a multiple of
// kInt8Block), for MR rows of x: ``xw`` their pairs as words (``ldx`` apart), ``xscale`` their blocks' scales
// (``ldb`` apart). The block's sums go to ``out`` (L1) each block, so only they are held in registers.
template <int MR>
inline void int8_slice(const int32_t* xw, int64_t ldx, const float* xscale, int64_t ldb, const int8_t* wp, int64_t p0,
                       int64_t p1, float* out, bool first) {
  constexpr int T = kInt8Tile<MR>;
  for (int64_t tile = 0; tile < kGroup; tile += T * kLanes) {
    for (int64_t b0 = p0; b0 < p1; b0 += kInt8Block) {
      vi sums[MR][T] = {};
      for (int64_t p = b0, b1 = std::min(p1, b0 + kInt8Block); p < b1; ++p) {
        const int8_t* w = wp + ((p - p0) * kGroup + tile) * 2;
        for (int j = 0; j < T; ++j) {
          const vw pair = __builtin_convertvector(load<vb>(w + 2 * kLanes * j), vw);
          for (int m = 0; m < MR; ++m) sums[m][j] += pair_dot(pair, xw[m * ldx + p]);
        }
      }
      for (int m = 0; m < MR; ++m) {
        const vf scale = splat(xscale[m * ldb + b0 / kInt8Block]);
        for (int j = 0; j < T; ++j) {
          float* o = out + m * kGroup + tile + kLanes * j;
          const vf before = first && b0 == p0 ? vf{} : load<vf>(o);
          put(o, before + __builtin_convertvector(sums[m][j], vf) * scale);
        }
      }
    }
  }
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
