/* y = x @ W^T on the CPU for W in one of GGUF's block formats, without dequantizing W in memory.
 *
 * Built by quantized_linear.py on first use (cc -O3 -march=native -fopenmp) and called through
 * ctypes. Plain C with GCC vector extensions, so the one source vectorises for AVX-512, AVX2 or
 * NEON alike, and builds in well under a second with no torch headers.
 *
 * A weight is N rows of K values, cut along K into blocks of 32 that share a scale d (and, for
 * Q4_1, an offset m); both are stored here as float32 arrays [N][K/32] (GGUF keeps fp16: the
 * conversion is exact). Values:
 *   Q4_0  d * (q - 8)   q in 0..15, 16 bytes a block: byte j holds q[j] (low nibble), q[j+16] (high)
 *   Q4_1  d * q + m     same nibbles
 *   Q8_0  d * q         q int8, 32 bytes a block
 * Each product d * q is exact in float32 (an fp16 significand times a 4- or 8-bit integer), so
 * computing d * q + m with or without a fused multiply-add rounds once, at the addition, exactly
 * as gguf-py's dequantize does in numpy: the values a row is multiplied by are bit for bit the
 * dequantized weights. Only the order of the dot products' additions differs from a BLAS on the
 * dequantized matrix (float32 rounding).
 *
 * The work is split over output rows. A thread dequantizes NR rows of W into a small buffer
 * (L1/L2-resident), then multiplies them with every row of x in MR x NR register tiles: one pass
 * over W's bytes per call whatever M is, which is the point at decode (M = batch size, W read
 * from DRAM once). At prefill sizes (M in the hundreds) the tiles run about as fast as torch's
 * GEMM on the dequantized matrix (2-core EPYC, fp32), so there is no second path for large M.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define VL 16   /* floats per vector */
#define NR 4    /* weight rows per tile */
#define MR 4    /* x rows per tile */

typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vf_u __attribute__((vector_size(VL * 4), aligned(4)));          /* unaligned loads */

enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };

/* 16 bytes to 16 floats. With intrinsics where there are: GCC 12 turns the portable spelling
 * (__builtin_convertvector of a byte vector) into 16 scalar conversions in these loops. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline vf u8_to_float(__m128i b) { return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
static inline vf s8_to_float(__m128i b) { return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
#elif defined(__AVX2__)
#include <immintrin.h>
static inline vf halves(__m256 a, __m256 b) {
    vf r;
    memcpy(&r, &a, 32);
    memcpy((char *)&r + 32, &b, 32);
    return r;
}
static inline vf u8_to_float(__m128i b) {
    return halves(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))));
}
static inline vf s8_to_float(__m128i b) {
    return halves(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))));
}
#endif

/* q[0..15] and q[16..31] of a 4-bit block; the 16 values of half an 8-bit block. */
static inline void nibbles_to_float(const uint8_t *p, vf *lo, vf *hi) {
#if defined(__AVX512F__) || defined(__AVX2__)
    const __m128i b = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(15);
    *lo = u8_to_float(_mm_and_si128(b, mask));
    *hi = u8_to_float(_mm_and_si128(_mm_srli_epi16(b, 4), mask));
#else
    for (int j = 0; j < VL; j++) {
        (*lo)[j] = (float)(p[j] & 15);
        (*hi)[j] = (float)(p[j] >> 4);
    }
#endif
}

static inline vf int8_to_float(const uint8_t *p) {
#if defined(__AVX512F__) || defined(__AVX2__)
    return s8_to_float(_mm_loadu_si128((const __m128i *)p));
#else
    vf r;
    for (int j = 0; j < VL; j++) r[j] = (float)(int8_t)p[j];
    return r;
#endif
}

/* Row n of W as K floats. qs: the row's quant bytes; d, m: its nb scales / offsets. */
static void dequant_row(int qtype, const uint8_t *qs, const float *d, const float *m, int64_t nb, float *out) {
    for (int64_t b = 0; b < nb; b++) {
        vf lo, hi;
        if (qtype == Q8_0) {
            lo = int8_to_float(qs + 32 * b) * d[b];
            hi = int8_to_float(qs + 32 * b + 16) * d[b];
        } else {
            nibbles_to_float(qs + 16 * b, &lo, &hi);
            if (qtype == Q4_0) {
                lo = (lo - 8.0f) * d[b];
                hi = (hi - 8.0f) * d[b];
            } else {
                lo = lo * d[b] + m[b];
                hi = hi * d[b] + m[b];
            }
        }
        *(vf_u *)(out + 32 * b) = lo;
        *(vf_u *)(out + 32 * b + 16) = hi;
    }
}

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

/* y[r][n0 + i] = x[r] . w[i] for r < mr, i < nr; w: NR rows of K floats. Called with constant mr
 * and nr so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void
tile(int mr, int nr, const float *x, int64_t K, const float *w, float *y, int64_t N, int64_t n0) {
    vf acc[MR][NR];
    for (int r = 0; r < mr; r++)
        for (int i = 0; i < nr; i++) acc[r][i] = (vf){0};
    for (int64_t k = 0; k < K; k += VL) {
        vf wv[NR];
        for (int i = 0; i < nr; i++) wv[i] = *(const vf_u *)(w + i * K + k);
        for (int r = 0; r < mr; r++) {
            const vf xv = *(const vf_u *)(x + r * K + k);
            for (int i = 0; i < nr; i++) acc[r][i] += xv * wv[i];
        }
    }
    for (int r = 0; r < mr; r++)
        for (int i = 0; i < nr; i++) y[r * N + n0 + i] = hsum(acc[r][i]);
}

static void rows_times_x(int nr, const float *x, int64_t M, int64_t K, const float *w, float *y, int64_t N, int64_t n0) {
    int64_t r = 0;
    if (nr == NR) {
        for (; r + MR <= M; r += MR) tile(MR, NR, x + r * K, K, w, y + r * N, N, n0);
        for (; r < M; r++) tile(1, NR, x + r * K, K, w, y + r * N, N, n0);
    } else {
        for (; r < M; r++)
            for (int i = 0; i < nr; i++) tile(1, 1, x + r * K, K, w + i * K, y + r * N, N, n0 + i);
    }
}

static int64_t row_bytes(int qtype, int64_t K) { return qtype == Q8_0 ? K : K / 2; }

/* x: [M][K] float32; qs: [N][row_bytes]; d, m: [N][K/32] (m only for Q4_1); y: [M][N] float32. */
int quantized_linear(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *qs, const float *d,
                     const float *m, int64_t N, float *y, int nthreads) {
    const int64_t nb = K / 32, rb = row_bytes(qtype, K);
    const int64_t tiles = (N + NR - 1) / NR;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        /* every thread must reach the omp for, so one whose buffer failed skips its tiles there */
        float *w = aligned_alloc(64, ((NR * K * sizeof(float)) + 63) / 64 * 64);
        if (!w) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (!w) continue;
            const int64_t n0 = t * NR;
            const int nr = N - n0 < NR ? (int)(N - n0) : NR;
            for (int i = 0; i < nr; i++)
                dequant_row(qtype, qs + (n0 + i) * rb, d + (n0 + i) * nb, m ? m + (n0 + i) * nb : 0, nb, w + i * K);
            rows_times_x(nr, x, M, K, w, y, N, n0);
        }
        free(w);
    }
    return failed ? -1 : 0;
}
