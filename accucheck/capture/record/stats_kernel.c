/* accucheck statistics kernel: every per-record statistic of a contiguous CPU tensor in ONE pass.
 *
 * Built on first use by accucheck/capture/stats.py (cc -O3 -shared, plus -mavx2 -mfma -mf16c
 * where the CPU has them) into the accucheck cache and called through ctypes; without a C
 * compiler the recorder uses its torch kernels instead (same statistics).
 *
 * accucheck_stats_<dtype>(x, n, out, sketch) writes the raw statistics row that
 * accucheck.capture.recorder.tensor_stats produces, as RAW doubles:
 *   out[0..3]  min, max, sum, L2 norm   (NaN-poisoned like torch: min = max = NaN when a NaN is
 *                                        present; sum / L2 propagate NaN / Inf)
 *   out[4..6]  NaN, Inf and zero counts (exact)
 *   out[7]     checksum: the sum of the raw bit patterns as signed integers, mod 2**52 (exact)
 *   out[8..]   SAMPLE values at flat positions (j * (n - 1)) / (SAMPLE - 1), NaN-padded when
 *              n < SAMPLE (every element then)
 *   out[8 + SAMPLE..]  the sketch row (accucheck/store/sketch.py, the reference definition):
 *              the exponent e of c, then SKETCH buckets of sign(x) log1p(|x| / c) with random
 *              signs; NaN when the tensor holds a NaN or an Inf, or without `sketch`. A second pass over the tensor
 *              (it needs the RMS): one log1p per element, the kernel's main cost.
 * Sums and sums of squares are accumulated in double lanes (float * float is exact in double),
 * so they are at least as accurate as torch's float32 reductions. Integer lane counters are
 * 32-bit inside a block of BLOCK elements (no overflow: BLOCK / LANES elements per lane).
 * Returns 0; n must be >= 1.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>

#define LANES 8
#define BLOCK 1024
#define SAMPLE 64
#define MASK52 ((uint64_t)0xFFFFFFFFFFFFFull)
#define SKETCH 128
#define SKETCH_FLOOR 1.0

/* the sketch's position tables: splitmix64 of seed * 2**32 + j (accucheck.store.sketch) */
static int32_t TG[512], TH[65536];
static double TSL[65536], TSH[65536];

static uint64_t mix(uint64_t seed, uint64_t j) {
    uint64_t z = ((seed << 32) + j) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Called once when the library is loaded, before any kernel. */
void accucheck_sketch_init(void) {
    for (uint64_t j = 0; j < 512; j++) TG[j] = (int32_t)(mix(1, j) & 127);
    for (uint64_t j = 0; j < 65536; j++) {
        TH[j] = (int32_t)(mix(2, j) & 127);
        TSL[j] = (mix(3, j) >> 63) ? -1.0 : 1.0;
        TSH[j] = (mix(4, j) >> 63) ? -1.0 : 1.0;
    }
}

/* z = sign(x) log1p(|x| inv) of a block of values. With ACCUCHECK_MVEC (stats.py builds with
 * it where glibc's vector math library links, plus -fno-math-errno) the loop calls libmvec's
 * vector log1p (<= 4 ulp: the sketch needs ~1e-12), about 5x faster than the scalar one. */
#ifdef ACCUCHECK_MVEC
extern double log1p(double) __attribute__((simd("notinbranch")));
#endif
static void sketch_z(const double *x, int64_t m, double inv, double *z) {
    for (int64_t r = 0; r < m; r++) z[r] = copysign(log1p(fabs(x[r]) * inv), x[r]);
}

/* The sketch row of x (LOAD(x, i): element i as a double) into out[0..SKETCH]; q: the sum of
 * squares, bad: a NaN or an Inf is present. Groups of 128 aligned positions share G and H. */
#define SKETCH_PASS(x, n, q, bad, out, LOAD)                                                     \
    do {                                                                                         \
        double rms_ = sqrt((q) / (double)(n));                                                   \
        double e_ = rms_ > 0 ? floor(log2(SKETCH_FLOOR * rms_)) : 0.0;                           \
        (out)[0] = e_;                                                                           \
        for (int k_ = 0; k_ < SKETCH; k_++) (out)[1 + k_] = (bad) ? NAN : 0.0;                   \
        if (!(bad) && rms_ > 0) {                                                                \
            double inv_ = ldexp(1.0, -(int)e_);                                                  \
            for (int64_t g_ = 0; g_ < (n); g_ += 128) {                                          \
                int64_t hi_ = (g_ >> 16) & 65535;                                                \
                int32_t v_ = TG[(g_ >> 7) & 511] ^ TH[hi_];                                      \
                double sh_ = TSH[hi_];                                                           \
                const double *sl_ = TSL + (g_ & 65535);                                          \
                int64_t m_ = (n) - g_ < 128 ? (n) - g_ : 128;                                    \
                double xv_[128], z_[128];                                                        \
                for (int64_t r_ = 0; r_ < m_; r_++) xv_[r_] = LOAD(x, g_ + r_);                  \
                sketch_z(xv_, m_, inv_, z_);                                                     \
                for (int64_t r_ = 0; r_ < m_; r_++)                                              \
                    (out)[1 + ((int32_t)r_ ^ v_)] += sh_ * sl_[r_] * z_[r_];                     \
            }                                                                                    \
        }                                                                                        \
    } while (0)

static void sample_positions(int64_t n, int64_t *pos) {
    for (int j = 0; j < SAMPLE; j++) pos[j] = n >= SAMPLE ? (j * (n - 1)) / (SAMPLE - 1) : j;
}

static void finish(double *out, double mn, double mx, double s, double q, int64_t nan_,
                   int64_t inf_, int64_t zero, uint64_t bits) {
    if (nan_) { mn = NAN; mx = NAN; }
    out[0] = mn; out[1] = mx; out[2] = s; out[3] = sqrt(q);
    out[4] = (double)nan_; out[5] = (double)inf_; out[6] = (double)zero;
    out[7] = (double)(bits & MASK52);  /* == Python's (sum mod 2**52): 2**52 divides 2**64 */
}

/* The lane loop shared by float32 and the 16-bit types: V(j) is element j of the block as a
 * float, W(j) its raw bits as a signed int32; ABSMASK / EXPMASK classify NaN / Inf / zero on
 * the bits. Sums in double lanes (float * float products are exact in double). */
#define LANE_LOOP(V, W, ABSMASK, EXPMASK)                                                        \
        double fs[LANES] = {0}, fq[LANES] = {0};                                                 \
        int32_t z[LANES] = {0}, na[LANES] = {0}, in[LANES] = {0}, hi[LANES] = {0}, lo[LANES] = {0}; \
        for (int j = 0; j < BLOCK; j += LANES) {                                                 \
            for (int k = 0; k < LANES; k++) {                                                    \
                float v = V(j + k); int32_t w = W(j + k); int32_t a = w & ABSMASK;               \
                mn[k] = v < mn[k] ? v : mn[k]; mx[k] = v > mx[k] ? v : mx[k];                    \
                fs[k] += v; fq[k] += (double)v * v;                                              \
                z[k] += a == 0; na[k] += a > EXPMASK; in[k] += a == EXPMASK;                     \
                hi[k] += w >> 16; lo[k] += w & 0xFFFF;                                           \
            }                                                                                    \
        }                                                                                        \
        int64_t h = 0, l = 0;                                                                    \
        for (int k = 0; k < LANES; k++) {                                                        \
            s += fs[k]; q += fq[k]; cz += z[k]; cn += na[k]; ci += in[k]; h += hi[k]; l += lo[k]; \
        }                                                                                        \
        bs += (uint64_t)h * 65536u + (uint64_t)l;

/* A whole kernel: WIDEN(xb) prepares the block (16-bit types: into float / int32 buffers, in
 * a loop of its own so that both loops vectorize), LOAD(x, i) / BITS(x, i) read element i. */
#define KERNEL(NAME, T, WIDEN, V, W, LOAD, BITS, ABSMASK, EXPMASK)                               \
int NAME(const T *x, int64_t n, double *out, int sketch) {                                                   \
    float mn[LANES], mx[LANES];                                                                  \
    for (int k = 0; k < LANES; k++) { mn[k] = INFINITY; mx[k] = -INFINITY; }                     \
    double s = 0, q = 0; int64_t cz = 0, cn = 0, ci = 0; uint64_t bs = 0;                         \
    float vb[BLOCK]; int32_t wb[BLOCK]; (void)vb; (void)wb;                                      \
    int64_t i = 0;                                                                               \
    for (; i + BLOCK <= n; i += BLOCK) {                                                         \
        const T *xb = x + i; (void)xb;                                                           \
        WIDEN(xb)                                                                                \
        LANE_LOOP(V, W, ABSMASK, EXPMASK)                                                        \
    }                                                                                            \
    float gmn = INFINITY, gmx = -INFINITY;                                                       \
    for (int k = 0; k < LANES; k++) { gmn = mn[k] < gmn ? mn[k] : gmn; gmx = mx[k] > gmx ? mx[k] : gmx; } \
    for (; i < n; i++) {                                                                         \
        float v = LOAD(x, i); int32_t w = BITS(x, i); int32_t a = w & ABSMASK;                   \
        gmn = v < gmn ? v : gmn; gmx = v > gmx ? v : gmx; s += v; q += (double)v * v;            \
        cz += a == 0; cn += a > EXPMASK; ci += a == EXPMASK; bs += (uint64_t)(int64_t)w;         \
    }                                                                                            \
    finish(out, gmn, gmx, s, q, cn, ci, cz, bs);                                                 \
    int64_t pos[SAMPLE]; sample_positions(n, pos);                                               \
    for (int j = 0; j < SAMPLE; j++) out[8 + j] = j < n ? (double)LOAD(x, pos[j]) : NAN;          \
    if (sketch) SKETCH_PASS(x, n, q, cn || ci, out + 8 + SAMPLE, LOAD);                          \
    else for (int k = 0; k <= SKETCH; k++) out[8 + SAMPLE + k] = NAN;                           \
    return 0;                                                                                    \
}

typedef union { uint32_t u; float f; } pun32;
static inline float bf16_value(uint16_t b) { pun32 p; p.u = (uint32_t)b << 16; return p.f; }

/* float32: read in place */
#define NO_WIDEN(xb)
#define F32_V(j) (xb[j])
#define F32_W(j) (((const int32_t *)xb)[j])
#define F32_LOAD(x, i) ((x)[i])
#define F32_BITS(x, i) (((const int32_t *)(x))[i])
KERNEL(accucheck_stats_f32, float, NO_WIDEN, F32_V, F32_W, F32_LOAD, F32_BITS,
       0x7FFFFFFF, 0x7F800000)

/* 16-bit: widened block by block */
#define BUF_V(j) (vb[j])
#define BUF_W(j) (wb[j])
#define I16_BITS(x, i) ((int32_t)((const int16_t *)(x))[i])
#define BF16_LOAD(x, i) bf16_value((x)[i])
#define BF16_WIDEN(xb) for (int j = 0; j < BLOCK; j++) { vb[j] = BF16_LOAD(xb, j); wb[j] = I16_BITS(xb, j); }
KERNEL(accucheck_stats_bf16, uint16_t, BF16_WIDEN, BUF_V, BUF_W, BF16_LOAD, I16_BITS,
       0x7FFF, 0x7F80)

#ifdef __FLT16_MAX__
#define F16_LOAD(x, i) ((float)((const _Float16 *)(x))[i])
#define F16_WIDEN(xb) for (int j = 0; j < BLOCK; j++) { vb[j] = F16_LOAD(xb, j); wb[j] = I16_BITS(xb, j); }
KERNEL(accucheck_stats_f16, uint16_t, F16_WIDEN, BUF_V, BUF_W, F16_LOAD, I16_BITS,
       0x7FFF, 0x7C00)
int accucheck_has_f16(void) { return 1; }
#else
int accucheck_stats_f16(const uint16_t *x, int64_t n, double *out, int sketch) { (void)x; (void)n; (void)out; (void)sketch; return -1; }
int accucheck_has_f16(void) { return 0; }
#endif

/* float64: double lanes, 64-bit counters and a wrapping 64-bit bit-pattern sum (torch's int64
 * sum wraps the same way; 2**52 divides 2**64, so the checksum is exact). */
int accucheck_stats_f64(const double *x, int64_t n, double *out, int sketch) {
    double mn[LANES], mx[LANES], fs[LANES] = {0}, fq[LANES] = {0};
    int64_t z[LANES] = {0}, na[LANES] = {0}, in[LANES] = {0}; uint64_t bs[LANES] = {0};
    for (int k = 0; k < LANES; k++) { mn[k] = INFINITY; mx[k] = -INFINITY; }
    const int64_t *bits = (const int64_t *)x;
    const int64_t ABS = 0x7FFFFFFFFFFFFFFFll, EXP = 0x7FF0000000000000ll;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        for (int k = 0; k < LANES; k++) {
            double v = x[i + k]; int64_t w = bits[i + k]; int64_t a = w & ABS;
            mn[k] = v < mn[k] ? v : mn[k]; mx[k] = v > mx[k] ? v : mx[k];
            fs[k] += v; fq[k] += v * v;
            z[k] += a == 0; na[k] += a > EXP; in[k] += a == EXP; bs[k] += (uint64_t)w;
        }
    }
    double gmn = INFINITY, gmx = -INFINITY, s = 0, q = 0; int64_t cz = 0, cn = 0, ci = 0;
    uint64_t b = 0;
    for (int k = 0; k < LANES; k++) {
        gmn = mn[k] < gmn ? mn[k] : gmn; gmx = mx[k] > gmx ? mx[k] : gmx;
        s += fs[k]; q += fq[k]; cz += z[k]; cn += na[k]; ci += in[k]; b += bs[k];
    }
    for (; i < n; i++) {
        double v = x[i]; int64_t w = bits[i]; int64_t a = w & ABS;
        gmn = v < gmn ? v : gmn; gmx = v > gmx ? v : gmx; s += v; q += v * v;
        cz += a == 0; cn += a > EXP; ci += a == EXP; b += (uint64_t)w;
    }
    finish(out, gmn, gmx, s, q, cn, ci, cz, b);
    int64_t pos[SAMPLE]; sample_positions(n, pos);
    for (int j = 0; j < SAMPLE; j++) out[8 + j] = j < n ? x[pos[j]] : NAN;
#define F64_LOAD(x, i) ((x)[i])
    if (sketch) SKETCH_PASS(x, n, q, cn || ci, out + 8 + SAMPLE, F64_LOAD);
    else for (int k = 0; k <= SKETCH; k++) out[8 + SAMPLE + k] = NAN;
    return 0;
}
