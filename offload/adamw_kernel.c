/* SlideFSDP's CPU AdamW step in one pass over memory (offload/adamw_kernel.py builds and calls it).

   Each element is read and written once: the gradient read (float32, bfloat16 or float16), the master (float32, or
   bfloat16 rounded stochastically on the way back: see `master_bits`) read and written, the moments (float32 or bfloat16, and amsgrad's running maximum) read and written in place, and the
   new weight written to the staging row (bfloat16, float16, float32, or not at all). The arithmetic is that of torch's
   fused CPU AdamW kernel (aten/src/ATen/native/cpu/FusedAdamKernel.cpp, ADAMW mode), operation for operation, so that
   float32 moments give its bits: the weight decayed first, exp_avg by lerp as one fused multiply-add, exp_avg_sq
   as fma((1 - beta2) * g, g, beta2 * v) (how torch's build contracts it in the vector loop; its scalar loop over a
   tensor's last elements may round otherwise: the caller says how, see `step`), denom = sqrt(v) / sqrt(bias_correction2) + eps, and
   p + (-step_size * m) / denom. bfloat16 moments are widened exactly, updated in float32 and rounded to nearest-even
   when stored; the step uses the unrounded values, as the fused kernel on float32 copies does. The file is compiled
   with -ffp-contract=off so that the compiler fuses nothing the fused kernel does not.

   The loop is written for the compiler's auto-vectoriser (one specialised copy per combination of dtypes, bfloat16
   by integer shifts); threads take contiguous ranges, cache-line aligned. */

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

enum { F32 = 0, BF16 = 1, F16 = 2, NONE = 3 };

typedef struct {
    void *param;
    const void *grad;
    void *exp_avg, *exp_avg_sq, *max_exp_avg_sq, *staging;
    int64_t begin, end;
    float grad_scale;   /* the gradient's multiplier; negative under maximize */
    float decay;        /* 1 - lr * weight_decay */
    float lerp_coeff;   /* exp_avg.lerp_(grad, w): w where |w| < 0.5, else w - 1 (torch's lerp) */
    int lerp_from_avg;  /* |w| < 0.5: exp_avg + w * (g - exp_avg), else g + (w - 1) * (g - exp_avg) */
    int tail_mode;      /* how the fused kernel's scalar loop rounds exp_avg_sq (see `step`) */
    float beta2, sq_coeff, bias_correction2_sqrt, eps, neg_step_size;
    int grad_dtype, moment_dtype, staging_dtype, amsgrad;
    int master_dtype;   /* F32, or BF16 (the master rounded by `master_bits`) */
    int stochastic;     /* a bfloat16 master: 1 rounds stochastically, 0 to nearest-even (a benchmark's control) */
    uint32_t seed;      /* the stochastic rounding's seed for this call (the caller's: step, unit, piece, rank) */
    uint32_t position;  /* the counter of element 0 of this call: its index in the parameter's rows */
} Job;

static inline float from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline __attribute__((always_inline)) float load(const void *p, int64_t i, const int dtype) {
    if (dtype == F32) return ((const float *)p)[i];
#ifdef __FLT16_MAX__
    if (dtype == F16) return (float)((const _Float16 *)p)[i];
#endif
    return from_bits((uint32_t)((const uint16_t *)p)[i] << 16);  /* bfloat16: the upper half of a float32 */
}

/* float32 to bfloat16, rounded to nearest-even; a NaN stays a (quiet) NaN */
static inline uint16_t bf16(float f) {
    uint32_t u = to_bits(f);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return f != f ? (uint16_t)((u >> 16) | 0x40u) : (uint16_t)rounded;
}

/* A counter-based generator: Chris Wellons' lowbias32 hash of the seed and the element's position, so the bits an
   element is rounded with depend on (step, unit, piece, rank, position) alone: threads, chunking and a resumed run
   take the same ones. 32-bit multiplies, which AVX2 vectorises. */
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

/* float32 to bfloat16, rounded stochastically: 16 random bits added below the kept ones, then cut, so a value rounds
   up with probability its distance from the lower neighbour over the gap (unbiased; Zamirai et al., arXiv
   2010.06192). Infinities and NaN keep the nearest rounding. */
static inline uint16_t master_bits(float f, uint32_t seed, uint32_t position, int stochastic) {
    uint32_t u = to_bits(f);
    if (!stochastic || (u & 0x7F800000u) == 0x7F800000u) return bf16(f);
    return (uint16_t)((u + (mix32(position ^ seed) & 0xFFFFu)) >> 16);
}

static inline __attribute__((always_inline)) void store(void *p, int64_t i, float value, const int dtype) {
    if (dtype == F32) ((float *)p)[i] = value;
    else if (dtype == BF16) ((uint16_t *)p)[i] = bf16(value);
#ifdef __FLT16_MAX__
    else if (dtype == F16) ((_Float16 *)p)[i] = (_Float16)value;
#endif
}

/* `sq_mode`: how exp_avg_sq = beta2 * v + ((1 - beta2) * g) * g is rounded. 0: as one fused multiply-add onto
   beta2 * v, as torch's build contracts the fused kernel's vector loop; its scalar loop over a tensor's last elements
   (fewer than one vector) is compiled otherwise: 1, no fused multiply-add, or 2, one onto ((1 - beta2) * g) * g. */
static inline __attribute__((always_inline)) void step(const Job *job, const int pd, const int gd, const int md,
                                                       const int sd, const int amsgrad, const int sq_mode) {
    void *restrict param = job->param;
    const void *restrict grad = job->grad;
    void *restrict exp_avg = job->exp_avg;
    void *restrict exp_avg_sq = job->exp_avg_sq;
    void *restrict peak = job->max_exp_avg_sq;
    void *restrict staging = job->staging;
    const float scale = job->grad_scale, decay = job->decay, coeff = job->lerp_coeff, beta2 = job->beta2;
    const float sq_coeff = job->sq_coeff, bc2 = job->bias_correction2_sqrt, eps = job->eps, lr = job->neg_step_size;
    const int from_avg = job->lerp_from_avg, stochastic = job->stochastic;
    const uint32_t seed = job->seed, position = job->position;
    for (int64_t i = job->begin; i < job->end; i++) {
        float g = load(grad, i, gd) * scale;
        float p = load(param, i, pd) * decay;
        float m = load(exp_avg, i, md);
        float v = load(exp_avg_sq, i, md);
        m = fmaf(coeff, g - m, from_avg ? m : g);
        v = sq_mode == 0 ? fmaf(sq_coeff * g, g, v * beta2)
            : sq_mode == 1 ? v * beta2 + sq_coeff * g * g : fmaf(v, beta2, sq_coeff * g * g);
        store(exp_avg, i, m, md);
        store(exp_avg_sq, i, v, md);
        if (amsgrad) {
            float top = load(peak, i, md);
            v = top > v ? top : v;
            store(peak, i, v, md);
        }
        float denom = sqrtf(v) / bc2 + eps;
        p = p + lr * m / denom;
        if (pd == BF16) {  /* the staging copy takes the master's bits: the same weights on the host and the device */
            uint16_t bits = master_bits(p, seed, position + (uint32_t)i, stochastic);
            ((uint16_t *)param)[i] = bits;
            p = from_bits((uint32_t)bits << 16);
        } else {
            ((float *)param)[i] = p;
        }
        if (sd != NONE) store(staging, i, p, sd);
    }
}

/* one specialised copy of the loop per dtype combination: the dtypes are constants inside each */
#define STEP_STAGING(pd, gd, md, am)                           \
    switch (job->staging_dtype) {                              \
        case F32: step(job, pd, gd, md, F32, am, 0); return 0;   \
        case BF16: step(job, pd, gd, md, BF16, am, 0); return 0; \
        case F16: step(job, pd, gd, md, F16, am, 0); return 0;   \
        case NONE: step(job, pd, gd, md, NONE, am, 0); return 0; \
    }                                                          \
    return 1;
#define STEP_MASTER(gd, md, am) \
    if (job->master_dtype == BF16) { STEP_STAGING(BF16, gd, md, am) } else { STEP_STAGING(F32, gd, md, am) }
#define STEP_AMSGRAD(gd, md) if (job->amsgrad) { STEP_MASTER(gd, md, 1) } else { STEP_MASTER(gd, md, 0) }

static int run(const Job *job) {
    if (job->grad_dtype == F32 && job->moment_dtype == F32) { STEP_AMSGRAD(F32, F32) }
    if (job->grad_dtype == BF16 && job->moment_dtype == F32) { STEP_AMSGRAD(BF16, F32) }
    if (job->grad_dtype == F32 && job->moment_dtype == BF16) { STEP_AMSGRAD(F32, BF16) }
    if (job->grad_dtype == BF16 && job->moment_dtype == BF16) { STEP_AMSGRAD(BF16, BF16) }
#ifdef __FLT16_MAX__
    if (job->grad_dtype == F16 && job->moment_dtype == F32) { STEP_AMSGRAD(F16, F32) }
    if (job->grad_dtype == F16 && job->moment_dtype == BF16) { STEP_AMSGRAD(F16, BF16) }
#endif
    return 1;
}

/* A tensor's last elements, as the fused kernel's scalar loop computes them (one generic copy: a few elements) */
static void run_tail(const Job *job) {
    step(job, job->master_dtype, job->grad_dtype, job->moment_dtype, job->staging_dtype, job->amsgrad, job->tail_mode);
}

static void *run_thread(void *job) {
    run((const Job *)job);
    return NULL;
}

/* Whether the dtype combination can be run (float16 needs the compiler's _Float16). */
int lit_adamw_supported(int grad_dtype, int moment_dtype, int staging_dtype) {
#ifdef __FLT16_MAX__
    const int half = 1;
#else
    const int half = 0;
#endif
    int gradient = grad_dtype == F32 || grad_dtype == BF16 || (grad_dtype == F16 && half);
    int moments = moment_dtype == F32 || moment_dtype == BF16;
    int target = staging_dtype == F32 || staging_dtype == BF16 || staging_dtype == NONE || (staging_dtype == F16 && half);
    return gradient && moments && target;
}

#define MAX_THREADS 256
#define MIN_PER_THREAD 65536  /* below this a thread's start costs more than its share of the work */

/* One AdamW step of elements [0, n) on `threads` threads (the caller's included), each on a contiguous range aligned
   to 16 elements; the last `tail` elements as the fused kernel's scalar loop computes them (`tail_mode`, see `step`).
   A bfloat16 master's element i is rounded with counter `position + i` under `seed` (`master_bits`). Returns 0, or 1 for an unsupported dtype combination (nothing written). */
int lit_adamw_step(void *param, const void *grad, void *exp_avg, void *exp_avg_sq, void *max_exp_avg_sq,
                   void *staging, int64_t n, int64_t tail, int tail_mode, int master_dtype, int grad_dtype,
                   int moment_dtype, int staging_dtype, int amsgrad, float grad_scale, float decay, float lerp_weight,
                   float beta2, float sq_coeff, float bias_correction2_sqrt, float eps, float neg_step_size,
                   int stochastic, uint32_t seed, uint32_t position, int threads) {
    if (!lit_adamw_supported(grad_dtype, moment_dtype, staging_dtype) || (master_dtype != F32 && master_dtype != BF16) ||
        tail < 0 || tail > n || tail_mode < 0 || tail_mode > 2)
        return 1;
    Job base = {param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, staging, n - tail, n, grad_scale, decay,
                fabsf(lerp_weight) < 0.5f ? lerp_weight : lerp_weight - 1.0f, fabsf(lerp_weight) < 0.5f, tail_mode,
                beta2, sq_coeff, bias_correction2_sqrt, eps, neg_step_size,
                grad_dtype, moment_dtype, staging_dtype, amsgrad, master_dtype, stochastic, seed, position};
    if (tail > 0) run_tail(&base);
    n -= tail;
    base.begin = 0;
    base.end = n;
    int64_t most = n / MIN_PER_THREAD > 1 ? n / MIN_PER_THREAD : 1;
    if (threads > most) threads = (int)most;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads <= 1) return run(&base);
    Job jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    int64_t share = (n / threads + 15) & ~(int64_t)15;
    for (int t = 0; t < threads; t++) {
        jobs[t] = base;
        jobs[t].begin = share * t < n ? share * t : n;
        jobs[t].end = share * (t + 1) < n && t + 1 < threads ? share * (t + 1) : n;
    }
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], NULL, run_thread, &jobs[t]) == 0;
    run(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(ids[t], NULL);
        else run(&jobs[t]);  /* no thread to be had: the caller does its range */
    }
    return 0;
}
