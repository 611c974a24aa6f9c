/* A command-line front end to slime_ascend/quant/native_kernels.c, for testing a build of the
 * kernels on another architecture under user-mode emulation (tests/quant/test_quant_aarch64.py):
 * the tensors travel as raw little-endian bytes on stdin / stdout, and the test compares the results
 * with torch on the host. Built together with native_kernels.c, with the flags native.py uses.
 *
 *   absmax DT ROWS COLS GROUP NT                     stdin x; stdout fp32 [ROWS, ceil(COLS/GROUP)]
 *   fp8 DT ROWS COLS BN BK FLOOR FMAX NT             stdin x; stdout fp32 scale [nb, kb], then q bytes
 *   int DT ROWS COLS GROUP MODE QMIN QMAX NT         stdin x, then fp32 div [ROWS, ngroups]; stdout int8 q
 *                                                    (MODE: sa_int_quantize's, 1 reciprocal | 2 bf16 / 4 fp16
 *                                                    quotient rounding)
 *   sweep START STOP STEP SIGN WIDTH NT              the fp32 bit patterns START, START + STEP, ... below
 *                                                    STOP (STOP <= 448's + 1) with sign bit SIGN, as rows
 *                                                    of WIDTH values plus a 448 (so every block's scale
 *                                                    is 1); stdout: the values' e4m3 codes, in order
 * DT: 0 fp32, 1 bf16, 2 fp16. Exit status 2 on a usage or I/O error.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int sa_abi_version(void);
int sa_openmp(void);
void sa_group_absmax(const void *x, int dt, int64_t rows, int64_t cols, int64_t xs, int64_t group, float *out,
                     int64_t os, int nt);
int sa_fp8_block_quantize(const void *x, int dt, int64_t rows, int64_t cols, int64_t xs, int64_t bn, int64_t bk,
                          float floor_, float fmax, float *scale, int64_t ss, uint8_t *q, int64_t qs, int nt);
void sa_int_quantize(const void *x, int dt, int64_t rows, int64_t cols, int64_t xs, const float *d, int64_t ds,
                     int64_t group, int mode, float qmin, float qmax, int8_t *q, int64_t qs, int nt);

static void die(const char *why) {
    fprintf(stderr, "native_kernels_driver: %s\n", why);
    exit(2);
}

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) die("out of memory");
    return p;
}

static void read_all(void *p, size_t n) {
    if (fread(p, 1, n, stdin) != n) die("short read on stdin");
}

static void write_all(const void *p, size_t n) {
    if (fwrite(p, 1, n, stdout) != n) die("short write on stdout");
}

static size_t elem(int dt) { return dt == 0 ? 4 : 2; }

int main(int argc, char **argv) {
    if (argc < 2) die("usage: absmax|fp8|int|sweep ARGS (see the source)");
    if (sa_abi_version() != 3 || !sa_openmp()) die("unexpected ABI version or no OpenMP");
    const char *cmd = argv[1];
    if (!strcmp(cmd, "absmax") && argc == 7) {
        int dt = atoi(argv[2]), nt = atoi(argv[6]);
        int64_t rows = atoll(argv[3]), cols = atoll(argv[4]), group = atoll(argv[5]), ng = (cols + group - 1) / group;
        void *x = xmalloc((size_t)(rows * cols) * elem(dt));
        float *out = xmalloc((size_t)(rows * ng) * 4);
        read_all(x, (size_t)(rows * cols) * elem(dt));
        sa_group_absmax(x, dt, rows, cols, cols, group, out, ng, nt);
        write_all(out, (size_t)(rows * ng) * 4);
    } else if (!strcmp(cmd, "fp8") && argc == 10) {
        int dt = atoi(argv[2]), nt = atoi(argv[9]);
        int64_t rows = atoll(argv[3]), cols = atoll(argv[4]), bn = atoll(argv[5]), bk = atoll(argv[6]);
        float floor_ = strtof(argv[7], NULL), fmax = strtof(argv[8], NULL);
        int64_t nb = (rows + bn - 1) / bn, kb = (cols + bk - 1) / bk;
        void *x = xmalloc((size_t)(rows * cols) * elem(dt));
        float *s = xmalloc((size_t)(nb * kb) * 4);
        uint8_t *q = xmalloc((size_t)(rows * cols));
        read_all(x, (size_t)(rows * cols) * elem(dt));
        if (sa_fp8_block_quantize(x, dt, rows, cols, cols, bn, bk, floor_, fmax, s, kb, q, cols, nt)) die("fp8 failed");
        write_all(s, (size_t)(nb * kb) * 4);
        write_all(q, (size_t)(rows * cols));
    } else if (!strcmp(cmd, "int") && argc == 10) {
        int dt = atoi(argv[2]), mode = atoi(argv[6]), nt = atoi(argv[9]);
        int64_t rows = atoll(argv[3]), cols = atoll(argv[4]), group = atoll(argv[5]), ng = (cols + group - 1) / group;
        float qmin = strtof(argv[7], NULL), qmax = strtof(argv[8], NULL);
        void *x = xmalloc((size_t)(rows * cols) * elem(dt));
        float *d = xmalloc((size_t)(rows * ng) * 4);
        int8_t *q = xmalloc((size_t)(rows * cols));
        read_all(x, (size_t)(rows * cols) * elem(dt));
        read_all(d, (size_t)(rows * ng) * 4);
        sa_int_quantize(x, dt, rows, cols, cols, d, ng, group, mode, qmin, qmax, q, cols, nt);
        write_all(q, (size_t)(rows * cols));
    } else if (!strcmp(cmd, "sweep") && argc == 8) {
        uint64_t start = strtoull(argv[2], NULL, 0), stop = strtoull(argv[3], NULL, 0), step = strtoull(argv[4], NULL, 0);
        uint32_t sign = atoi(argv[5]) ? 0x80000000u : 0u;
        int64_t width = atoll(argv[6]), rows_per_call = 4096;
        int nt = atoi(argv[7]);
        if (stop > 0x43E00001u || start > stop || step < 1 || width < 1) die("sweep: bad range, step or width");
        float *x = xmalloc((size_t)(rows_per_call * (width + 1)) * 4);
        uint8_t *q = xmalloc((size_t)(rows_per_call * (width + 1)));
        float *s = xmalloc((size_t)rows_per_call * 4);
        for (uint64_t b = start; b < stop;) {
            int64_t left = (int64_t)((stop - b + step - 1) / step);
            int64_t count = left < rows_per_call * width ? left : rows_per_call * width;
            int64_t rows = (count + width - 1) / width;
            for (int64_t i = 0; i < rows * width; i++) {
                uint32_t v = i < count ? ((uint32_t)(b + (uint64_t)i * step) | sign) : 0u;
                memcpy(x + (i / width) * (width + 1) + i % width, &v, 4);
            }
            for (int64_t r = 0; r < rows; r++) x[r * (width + 1) + width] = 448.0f;
            if (sa_fp8_block_quantize(x, 0, rows, width + 1, width + 1, 1, width + 1, 1e-12f, 448.0f, s, 1, q,
                                      width + 1, nt))
                die("fp8 failed");
            for (int64_t r = 0; r * width < count; r++) {  /* the values' codes, not the 448 column's */
                int64_t m = count - r * width < width ? count - r * width : width;
                write_all(q + r * (width + 1), (size_t)m);
            }
            b += (uint64_t)count * step;
        }
    } else {
        die("usage: absmax|fp8|int|sweep ARGS (see the source)");
    }
    if (fflush(stdout)) die("flush failed");
    return 0;
}
