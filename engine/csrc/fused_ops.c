/*
 * Fused element-wise ops of a decoder layer, bfloat16 on the CPU.
 *
 * A decode step of a small model is ~4,000 torch ops: RMSNorm alone is six
 * (upcast, square, mean, rsqrt, scale, downcast) plus the weight multiply
 * and the residual add, each a dispatch of a few microseconds for a few
 * kilobytes of work. These three calls replace ~25 ops per layer; each
 * rounds to bfloat16 where the torch path does (so the results agree with it
 * to the last bit or within one bf16 rounding where a sum is ordered
 * differently):
 *
 *   kvt_add_rmsnorm  h = bf16(h + delta) (optional, in place);
 *                    out = bf16(w * bf16(h * rsqrt(mean(h^2) + eps)))
 *   kvt_silu_mul     out = bf16(bf16(silu(gate)) * up)       gate|up = x[:, :I] | x[:, I:]
 *   kvt_rope         x[:, :heads] rotated in place, "rotate half" layout:
 *                    a = bf16(x1 * cos), b = bf16(x2 * cos)
 *                    x1' = bf16(a - x2 * sin), x2' = bf16(b + x1 * sin)
 *
 * All math in fp32. Rows are split over OpenMP threads when there are many
 * (a prefill); a decode's few rows run on the calling thread.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline float round_bf(float f) { return bf(to_bf(f)); }

#define PARALLEL_ROWS 32

void kvt_add_rmsnorm(uint16_t *h, const uint16_t *delta, const uint16_t *w, uint16_t *out,
                     int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *hr = h + r * dim;
        float sumsq = 0.0f;
        if (delta != NULL) {
            const uint16_t *dr = delta + r * dim;
            for (int64_t i = 0; i < dim; i++) {
                const float v = round_bf(bf(hr[i]) + bf(dr[i]));
                hr[i] = to_bf(v);
                sumsq += v * v;
            }
        } else {
            for (int64_t i = 0; i < dim; i++) {
                const float v = bf(hr[i]);
                sumsq += v * v;
            }
        }
        const float scale = 1.0f / sqrtf(sumsq / (float)dim + eps);
        uint16_t *orow = out + r * dim;
        for (int64_t i = 0; i < dim; i++) orow[i] = to_bf(bf(w[i]) * round_bf(bf(hr[i]) * scale));
    }
}

void kvt_silu_mul(const uint16_t *x, uint16_t *out, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = x + r * 2 * inter, *up = gate + inter;
        uint16_t *orow = out + r * inter;
        for (int64_t i = 0; i < inter; i++) {
            const float g = bf(gate[i]);
            const float s = round_bf(g / (1.0f + expf(-g)));
            orow[i] = to_bf(s * bf(up[i]));
        }
    }
}

void kvt_rope(uint16_t *x, int64_t row_stride, int64_t rows, int64_t heads, int64_t dim,
              const uint16_t *cos_table, const uint16_t *sin_table, const int64_t *positions) {
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *c = cos_table + positions[r] * half, *s = sin_table + positions[r] * half;
        for (int64_t hd = 0; hd < heads; hd++) {
            uint16_t *x1 = x + r * row_stride + hd * dim, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = bf(x1[i]), b = bf(x2[i]), ci = bf(c[i]), si = bf(s[i]);
                const float o1 = round_bf(round_bf(a * ci) - b * si);
                const float o2 = round_bf(round_bf(b * ci) + a * si);
                x1[i] = to_bf(o1);
                x2[i] = to_bf(o2);
            }
        }
    }
}

/*
 * The same three ops in float32 (hosts without native bf16 run the model in
 * float32). No rounding steps: the torch path's float32 ops round only at
 * the end of each op, and so do these; sums are ordered differently, so
 * results agree with it to a few float32 ulps.
 */
void kvt_add_rmsnorm_f32(float *h, const float *delta, const float *w, float *out, int64_t rows,
                         int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        float *hr = h + r * dim;
        float sumsq = 0.0f;
        if (delta != NULL) {
            const float *dr = delta + r * dim;
            for (int64_t i = 0; i < dim; i++) {
                const float v = hr[i] + dr[i];
                hr[i] = v;
                sumsq += v * v;
            }
        } else {
            for (int64_t i = 0; i < dim; i++) sumsq += hr[i] * hr[i];
        }
        const float scale = 1.0f / sqrtf(sumsq / (float)dim + eps);
        float *orow = out + r * dim;
        for (int64_t i = 0; i < dim; i++) orow[i] = w[i] * (hr[i] * scale);
    }
}

void kvt_silu_mul_f32(const float *x, float *out, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * 2 * inter, *up = gate + inter;
        float *orow = out + r * inter;
        for (int64_t i = 0; i < inter; i++) {
            const float g = gate[i];
            orow[i] = g / (1.0f + expf(-g)) * up[i];
        }
    }
}

void kvt_rope_f32(float *x, int64_t row_stride, int64_t rows, int64_t heads, int64_t dim,
                  const float *cos_table, const float *sin_table, const int64_t *positions) {
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_table + positions[r] * half, *s = sin_table + positions[r] * half;
        for (int64_t hd = 0; hd < heads; hd++) {
            float *x1 = x + r * row_stride + hd * dim, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}
