/* CPU kernels for the quantisers' bulk passes (slime_ascend/quant/native.py builds and loads this).
 *
 * Every function works on a 2-D row-major view: `rows` rows of `cols` elements, row stride `xs`
 * elements, element type `dt` (DT_F32, DT_BF16, DT_F16), and spreads its rows over `nt` OpenMP
 * threads. Built against the libgomp that torch already loaded (same soname), the kernels share
 * torch's thread pool instead of fighting its spinning workers for the cores.
 *
 * The numerics are the eager torch code's, value for value:
 *   - |max| is the max over |bits| (for non-negative floats the bit order is the value order, and
 *     NaN/inf sort above every finite value, so a non-finite weight gives a non-finite max);
 *   - y = x / s (or x * s) in fp32, IEEE division, no contraction (built with -ffp-contract=off);
 *   - integers, optionally: y rounded to bf16 or fp16 first (round to nearest even on the fp32 bits:
 *     torch's cast; what a division in that dtype gives, for compressed-tensors' arithmetic);
 *   - integers: round half to even by the 1.5 * 2^23 trick on a value first clamped to
 *     [qmin - 1, qmax + 1] (same result as torch.round then clamp), then clamp;
 *   - e4m3fn: clamp to +-fmax (fmax <= 448; a no-op, skipped, when fmax is 448) then the
 *     round-to-nearest-even cast torch does, written as integer arithmetic on the fp32 bits (normal
 *     range: re-bias and round away 20 mantissa bits; subnormal range: |y| + 2^14 rounds |y| to a
 *     multiple of 2^-9).
 * The quantisers check a build against their eager torch path on probe tensors before they trust
 * it (quant/fused.py, `verified`); the tests compare every kernel with torch references.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef int64_t i64;

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

#define SA_ABI_VERSION 3
int sa_abi_version(void) { return SA_ABI_VERSION; }

int sa_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

static inline uint32_t f32_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }
static inline float bits_f32(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline float bf16_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

/* exact fp16 -> fp32 (subnormals, +-0, inf and NaN included) in bit arithmetic that selects by
 * masks, so that loops over it vectorise (gcc 12's _Float16 cast stayed scalar: 4x slower) */
static inline float f16_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    uint32_t normal = sign | ((e + 112u) << 23) | (m << 13);
    uint32_t special = sign | 0x7F800000u | (m << 13);
    uint32_t sub = sign | f32_bits((float)m * 5.9604644775390625e-08f); /* m * 2^-24, exact */
    uint32_t is_sub = 0u - (uint32_t)(e == 0), is_special = 0u - (uint32_t)(e == 31);
    return bits_f32((sub & is_sub) | (special & is_special) | (normal & ~(is_sub | is_special)));
}

/* e4m3fn code of a finite y with |y| <= 448, round to nearest even (-0.0 keeps its sign), as a
 * uint32 (0..255). Both ranges are computed for every value and the result is picked by a mask, with
 * no branch: written as `normal ? a : b`, gcc sinks the subnormal path's float add into a branch and,
 * under the default -ftrapping-math, cannot if-convert it back without masked vector ops, so the loop
 * stayed scalar everywhere but AVX-512 (4x slower on AVX2 and NEON). */
static inline uint32_t e4m3(float y) {
    uint32_t b = f32_bits(y);
    uint32_t a = b & 0x7FFFFFFFu;
    uint32_t r = a - (120u << 23);                                 /* exponent re-bias 127 -> 7 */
    uint32_t normal = (r + 0x7FFFFu + ((r >> 20) & 1u)) >> 20;     /* RNE of the dropped 20 bits */
    uint32_t sub = f32_bits(bits_f32(a) + 16384.0f) - 0x46800000u; /* RNE(|y| * 2^9), |y| < 2^-6 */
    uint32_t is_normal = 0u - (uint32_t)(a >= 0x3C800000u);        /* 2^-6: smallest normal */
    return (normal & is_normal) | (sub & ~is_normal) | ((b >> 24) & 0x80u);
}

/* fp32 y rounded to bf16's 8 / fp16's 11 significant bits (to nearest, ties to even), as fp32, for the
 * integer code that follows. Float arithmetic (Veltkamp's split: t = c*y, t - (t - y) with c = 2^16 + 1 /
 * 2^13 + 1; needs -ffp-contract=off): the same loop with the rounding done on the fp32 bits ran 2.4x
 * slower (the int <-> float reinterpretations go through the stack in gcc's vector code). Checked
 * exhaustively against the bit rounding (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000 (fp16: 0xFFF, 13,
 * 0xFFFFE000): equal bits for every normal fp32 |y| <= 1e30, equal int8 and int4 codes for every finite y;
 * fp32 subnormals differ in bits but give code 0 either way. fp16's own subnormal steps (|y| < 2^-14)
 * and overflow (> 65504) change no code either. The callers clamp y to [qmin, qmax] first (so c*y
 * cannot overflow; see ROUND_LOOP). */
static inline float round_bf16(float y) {
    const float c = 65537.0f;
    const float t = c * y;
    return t - (t - y);
}
static inline float round_f16(float y) {
    const float c = 8193.0f;
    const float t = c * y;
    return t - (t - y);
}
static inline float clamp_q(float y, float qmin, float qmax) {
    y = y > qmax ? qmax : y;
    return y < qmin ? qmin : y;
}

/* sa_int_quantize's `mode`: bit 0 multiply by d (else divide); bits 1-2 the quotient's rounding */
enum { INT_RECIPROCAL = 1, INT_ROUND_BF16 = 2, INT_ROUND_F16 = 4 };

/* ---- per-span primitives, one set per element type (contiguous spans vectorise) ---------------- */

static inline uint32_t u16_bits(uint16_t v) { return v; }
static inline float f32_id(float v) { return v; }
static inline float bf16_absbits_value(uint32_t m) { return bf16_f32((uint16_t)m); }
static inline float f16_absbits_value(uint32_t m) { return f16_f32((uint16_t)m); }

/* The cast passes compute a tile of 32-bit codes, then narrow the tile to bytes in a second loop:
 * narrowing inside the arithmetic loop made gcc demote its operations to 16 and 8 bits part-way, with
 * packs and spills in the vector loop (about 1.5x slower). */
#define TILE 256
/* o = int8(round_half_even(ROUND(clamp(Y, qmin, qmax)))) over one tile: ROUND is the quotient's rounding
 * to bf16 / fp16 (f32_id: none). Clamping first is exact (rounding to a bf16/fp16 value and then to an
 * integer are monotone and the integer bounds are fixed points of both), so the code needs no second
 * clamp and fits the 1.5 * 2^23 rounding trick; the second loop narrows to bytes itself. Measured
 * (4096x14336 bf16, 2 threads): the earlier form (one loop: clamp to [qmin-1, qmax+1], round, clamp
 * again, then a separate narrowing loop) took 12 ms plain and 27 ms with the bf16 rounding (gcc's vector
 * code for the fused rounding stalled); this one about 10.5 ms for both (x86-64-v3 and AVX-512), and
 * 14 ms instead of 28 ms on the x86-64 baseline. */
#define INT_LOOP(Y, ROUND)                                                                          \
    do {                                                                                              \
        for (i64 i = 0; i < m; i++) f[i] = ROUND(clamp_q((Y), qmin, qmax));                           \
        for (i64 i = 0; i < m; i++) o[i0 + i] = (int8_t)(int32_t)((f[i] + 12582912.0f) - 12582912.0f); \
    } while (0)

/* SUF: name suffix; T: storage type; BITS: T -> its bits; ABSMASK: all but the sign bit;
 * TO_F32: T -> float (exact); ABSVAL: a max |bits| -> its float value */
#define DEFINE_SPANS(SUF, T, BITS, ABSMASK, TO_F32, ABSVAL)                                           \
    static uint32_t absbits_##SUF(const T *restrict p, i64 n) {                                        \
        uint32_t m = 0;                                                                               \
        for (i64 i = 0; i < n; i++) {                                                                 \
            uint32_t v = BITS(p[i]) & ABSMASK;                                                        \
            m = v > m ? v : m;                                                                        \
        }                                                                                             \
        return m;                                                                                     \
    }                                                                                                 \
    static inline float absval_##SUF(uint32_t m) { return ABSVAL(m); }                                 \
    static void fp8_span_##SUF(const T *restrict p, i64 n, float s, float fmax, int clamp,             \
                               uint8_t *restrict o) {                                                 \
        uint32_t c[TILE];                                                                             \
        for (i64 i0 = 0; i0 < n; i0 += TILE) {                                                        \
            const i64 m = n - i0 < TILE ? n - i0 : TILE;                                              \
            const T *restrict pi = p + i0;                                                            \
            if (clamp) {                                                                              \
                for (i64 i = 0; i < m; i++) {                                                         \
                    float y = TO_F32(pi[i]) / s;                                                      \
                    y = y > fmax ? fmax : y;                                                          \
                    y = y < -fmax ? -fmax : y;                                                        \
                    c[i] = e4m3(y);                                                                   \
                }                                                                                     \
            } else {                                                                                  \
                for (i64 i = 0; i < m; i++) c[i] = e4m3(TO_F32(pi[i]) / s);                           \
            }                                                                                         \
            for (i64 i = 0; i < m; i++) o[i0 + i] = (uint8_t)c[i];                                    \
        }                                                                                             \
    }                                                                                                 \
    static void int_span_##SUF(const T *restrict p, i64 n, float d, int mode, float qmin, float qmax,      \
                               int8_t *restrict o) {                                                  \
        float f[TILE];                                                                                \
        for (i64 i0 = 0; i0 < n; i0 += TILE) {                                                        \
            const i64 m = n - i0 < TILE ? n - i0 : TILE;                                              \
            const T *restrict pi = p + i0;                                                            \
            switch (mode) {                                                                           \
            case INT_RECIPROCAL: INT_LOOP(TO_F32(pi[i]) * d, f32_id); break;                          \
            case INT_ROUND_BF16: INT_LOOP(TO_F32(pi[i]) / d, round_bf16); break;                      \
            case INT_ROUND_BF16 | INT_RECIPROCAL: INT_LOOP(TO_F32(pi[i]) * d, round_bf16); break;     \
            case INT_ROUND_F16: INT_LOOP(TO_F32(pi[i]) / d, round_f16); break;                        \
            case INT_ROUND_F16 | INT_RECIPROCAL: INT_LOOP(TO_F32(pi[i]) * d, round_f16); break;       \
            default: INT_LOOP(TO_F32(pi[i]) / d, f32_id); break;                                      \
            }                                                                                         \
        }                                                                                             \
    }

DEFINE_SPANS(f32, float, f32_bits, 0x7FFFFFFFu, f32_id, bits_f32)
DEFINE_SPANS(bf16, uint16_t, u16_bits, 0x7FFFu, bf16_f32, bf16_absbits_value)
DEFINE_SPANS(f16, uint16_t, u16_bits, 0x7FFFu, f16_f32, f16_absbits_value)

static uint32_t absbits(const void *x, int dt, i64 off, i64 n) {
    if (dt == DT_F32) return absbits_f32((const float *)x + off, n);
    if (dt == DT_BF16) return absbits_bf16((const uint16_t *)x + off, n);
    return absbits_f16((const uint16_t *)x + off, n);
}

static float absbits_value(int dt, uint32_t m) {
    if (dt == DT_F32) return absval_f32(m);
    if (dt == DT_BF16) return absval_bf16(m);
    return absval_f16(m);
}

static void fp8_span(const void *x, int dt, i64 off, i64 n, float s, float fmax, int clamp, uint8_t *o) {
    if (dt == DT_F32) fp8_span_f32((const float *)x + off, n, s, fmax, clamp, o);
    else if (dt == DT_BF16) fp8_span_bf16((const uint16_t *)x + off, n, s, fmax, clamp, o);
    else fp8_span_f16((const uint16_t *)x + off, n, s, fmax, clamp, o);
}

static void int_span(const void *x, int dt, i64 off, i64 n, float d, int mode, float qmin, float qmax,
                     int8_t *o) {
    if (dt == DT_F32) int_span_f32((const float *)x + off, n, d, mode, qmin, qmax, o);
    else if (dt == DT_BF16) int_span_bf16((const uint16_t *)x + off, n, d, mode, qmin, qmax, o);
    else int_span_f16((const uint16_t *)x + off, n, d, mode, qmin, qmax, o);
}

/* ---- entry points ------------------------------------------------------------------------------ */

/* out[r, j] = max |x[r, j*group : (j+1)*group]| (the last group may be partial) */
void sa_group_absmax(const void *x, int dt, i64 rows, i64 cols, i64 xs, i64 group, float *out, i64 os, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
    for (i64 r = 0; r < rows; r++)
        for (i64 c0 = 0, j = 0; c0 < cols; c0 += group, j++) {
            i64 len = c0 + group < cols ? group : cols - c0;
            out[r * os + j] = absbits_value(dt, absbits(x, dt, r * xs + c0, len));
        }
}

/* FP8 block quantisation in one pass over the weight. scale[b, j] = max(amax, floor) / fmax in fp32
 * (a NaN/inf amax stays non-finite) and q[r, c] = e4m3(clamp(x[r, c] / scale[r / bn, c / bk], +-fmax)),
 * 0 < fmax <= 448. Each thread owns a contiguous range of row blocks and reduces the block maxima of
 * row block b + 1 while it quantises row block b, interleaved per column block, so the memory-bound
 * reduction overlaps the compute-bound cast. With fmax = 448 the clamp is skipped: |x| <= amax gives
 * |x / scale| <= 448 (1 + 2^-23), which the rounding below sends to 448 like the clamp would.
 * Returns 0, or -1 when the per-thread accumulators could not be allocated. */
int sa_fp8_block_quantize(const void *x, int dt, i64 rows, i64 cols, i64 xs, i64 bn, i64 bk, float floor_,
                          float fmax, float *scale, i64 ss, uint8_t *q, i64 qs, int nt) {
    const i64 nb = (rows + bn - 1) / bn, kb = (cols + bk - 1) / bk;
    const int clamp = fmax != 448.0f;
    int failed = 0;
#pragma omp parallel num_threads(nt)
    {
        i64 t = 0, nthreads = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nthreads = omp_get_num_threads();
#endif
        const i64 b0 = nb * t / nthreads, b1 = nb * (t + 1) / nthreads;
        uint32_t *acc = (uint32_t *)calloc((size_t)(kb > 0 ? kb : 1), sizeof(uint32_t));
        if (!acc) {
#pragma omp atomic write
            failed = 1;
        } else if (b0 < b1) {
            for (i64 r = b0 * bn; r < rows && r < (b0 + 1) * bn; r++)  /* prologue: maxima of block b0 */
                for (i64 c0 = 0, j = 0; c0 < cols; c0 += bk, j++) {
                    uint32_t v = absbits(x, dt, r * xs + c0, c0 + bk < cols ? bk : cols - c0);
                    acc[j] = v > acc[j] ? v : acc[j];
                }
            for (i64 b = b0; b < b1; b++) {
                float *s = scale + b * ss;
                for (i64 j = 0; j < kb; j++) {
                    float a = absbits_value(dt, acc[j]);
                    a = a < floor_ ? floor_ : a; /* NaN stays NaN, as torch's clamp */
                    s[j] = a / fmax;
                    acc[j] = 0;
                }
                const i64 r0 = b * bn, r1 = r0 + bn < rows ? r0 + bn : rows;
                const i64 n0 = r1, n1 = b + 1 < b1 ? (n0 + bn < rows ? n0 + bn : rows) : n0;
                for (i64 i = 0; r0 + i < r1 || n0 + i < n1; i++) {
                    const int quantise = r0 + i < r1, reduce = n0 + i < n1;
                    for (i64 c0 = 0, j = 0; c0 < cols; c0 += bk, j++) {
                        const i64 len = c0 + bk < cols ? bk : cols - c0;
                        if (quantise) fp8_span(x, dt, (r0 + i) * xs + c0, len, s[j], fmax, clamp, q + (r0 + i) * qs + c0);
                        if (reduce) {
                            uint32_t v = absbits(x, dt, (n0 + i) * xs + c0, len);
                            acc[j] = v > acc[j] ? v : acc[j];
                        }
                    }
                }
            }
        }
        free(acc);
    }
    return failed ? -1 : 0;
}

/* q[r, c] = clamp(round_half_even(y), qmin, qmax), y = x[r, c] / d[r, c / group] (x * d when `mode` has
 * INT_RECIPROCAL), first rounded to bf16 / fp16 when `mode` has INT_ROUND_BF16 / INT_ROUND_F16;
 * requires -128 <= qmin <= qmax <= 127 */
void sa_int_quantize(const void *x, int dt, i64 rows, i64 cols, i64 xs, const float *d, i64 ds, i64 group,
                     int mode, float qmin, float qmax, int8_t *q, i64 qs, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
    for (i64 r = 0; r < rows; r++)
        for (i64 c0 = 0, j = 0; c0 < cols; c0 += group, j++) {
            i64 len = c0 + group < cols ? group : cols - c0;
            int_span(x, dt, r * xs + c0, len, d[r * ds + j], mode, qmin, qmax, q + r * qs + c0);
        }
}
