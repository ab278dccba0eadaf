/* The chained KV block hashes of protocol/kv_hash.py, compiled: BLAKE2b-64 (RFC 7693) over
 * each block's parent hash, extra and tokens, computed without the GIL for long runs so that a
 * thread hashing a huge prompt does not hold up the event loop.
 *
 * chain_hash_bytes(parent, data, block_bytes, first_extra) -> bytes
 *     The hashes of every full block of ``data`` as native-endian 64-bit words (what
 *     ``array("Q").frombytes`` takes). The message hashed for a block is the parent's 8 bytes
 *     (little-endian), the extra's length (2 bytes, little-endian; the extra is
 *     ``first_extra`` on the first block only, else empty), the extra, then the block's bytes.
 *
 * protocol/kv_hash.py holds the same scheme in Python (hashlib) for installs built without a
 * compiler; tests/test_kv_hash_native.py checks that both give the same hashes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Runs shorter than this are hashed holding the GIL: giving it up and taking it back costs
 * more than hashing a few blocks (and taking it back may wait a whole switch interval). */
#define RELEASE_GIL_BYTES 4096

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
    0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
    0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

/* the message schedule of rounds 0-9; rounds 10 and 11 reuse rounds 0 and 1 */
static const uint8_t SIGMA[10][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
};

typedef struct {
    uint64_t h[8];
    uint64_t t;          /* bytes compressed so far (messages here are far below 2^64) */
    uint8_t buf[128];
    size_t fill;
} b2b;

static inline uint64_t rotr(uint64_t x, unsigned n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load64(const uint8_t *p) {
    return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16) |
           ((uint64_t)p[3] << 24) | ((uint64_t)p[4] << 32) | ((uint64_t)p[5] << 40) |
           ((uint64_t)p[6] << 48) | ((uint64_t)p[7] << 56);
}

#define G(a, b, c, d, x, y)                 \
    do {                                    \
        v[a] = v[a] + v[b] + (x);           \
        v[d] = rotr(v[d] ^ v[a], 32);       \
        v[c] = v[c] + v[d];                 \
        v[b] = rotr(v[b] ^ v[c], 24);       \
        v[a] = v[a] + v[b] + (y);           \
        v[d] = rotr(v[d] ^ v[a], 16);       \
        v[c] = v[c] + v[d];                 \
        v[b] = rotr(v[b] ^ v[c], 63);       \
    } while (0)

static void compress(b2b *s, int last) {
    uint64_t v[16], m[16];
    for (int i = 0; i < 16; i++) m[i] = load64(s->buf + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = s->h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= s->t;
    if (last) v[14] = ~v[14];
    for (int r = 0; r < 12; r++) {
        const uint8_t *z = SIGMA[r % 10];
        G(0, 4, 8, 12, m[z[0]], m[z[1]]);
        G(1, 5, 9, 13, m[z[2]], m[z[3]]);
        G(2, 6, 10, 14, m[z[4]], m[z[5]]);
        G(3, 7, 11, 15, m[z[6]], m[z[7]]);
        G(0, 5, 10, 15, m[z[8]], m[z[9]]);
        G(1, 6, 11, 12, m[z[10]], m[z[11]]);
        G(2, 7, 8, 13, m[z[12]], m[z[13]]);
        G(3, 4, 9, 14, m[z[14]], m[z[15]]);
    }
    for (int i = 0; i < 8; i++) s->h[i] ^= v[i] ^ v[i + 8];
}

static void b2b_init8(b2b *s) {
    memcpy(s->h, IV, sizeof IV);
    s->h[0] ^= 0x01010000ULL ^ 8;  /* no key, 8-byte digest */
    s->t = 0;
    s->fill = 0;
}

static void b2b_update(b2b *s, const uint8_t *p, size_t n) {
    while (n > 0) {
        if (s->fill == 128) {  /* a full buffer is compressed only once more input comes */
            s->t += 128;
            compress(s, 0);
            s->fill = 0;
        }
        size_t take = 128 - s->fill;
        if (take > n) take = n;
        memcpy(s->buf + s->fill, p, take);
        s->fill += take;
        p += take;
        n -= take;
    }
}

static uint64_t b2b_final8(b2b *s) {
    s->t += s->fill;
    memset(s->buf + s->fill, 0, 128 - s->fill);
    compress(s, 1);
    return s->h[0];  /* the digest's 8 bytes, read little-endian */
}

static void chain(uint64_t parent, const uint8_t *data, Py_ssize_t blocks,
                  Py_ssize_t block_bytes, const uint8_t *extra, Py_ssize_t extra_len,
                  uint64_t *out) {
    uint8_t head[10];
    for (Py_ssize_t i = 0; i < blocks; i++) {
        Py_ssize_t elen = i == 0 ? extra_len : 0;
        for (int k = 0; k < 8; k++) head[k] = (uint8_t)(parent >> (8 * k));
        head[8] = (uint8_t)(elen & 0xff);
        head[9] = (uint8_t)((elen >> 8) & 0xff);
        b2b s;
        b2b_init8(&s);
        b2b_update(&s, head, sizeof head);
        if (elen) b2b_update(&s, extra, (size_t)elen);
        b2b_update(&s, data + i * block_bytes, (size_t)block_bytes);
        parent = b2b_final8(&s);
        out[i] = parent;
    }
}

static PyObject *chain_hash_bytes(PyObject *self, PyObject *args) {
    PyObject *parent_obj;
    Py_buffer data, extra;
    Py_ssize_t block_bytes;
    (void)self;
    extra.buf = NULL;
    extra.len = 0;
    if (!PyArg_ParseTuple(args, "O!y*n|y*", &PyLong_Type, &parent_obj, &data, &block_bytes,
                          &extra))
        return NULL;
    PyObject *result = NULL;
    unsigned long long parent = PyLong_AsUnsignedLongLong(parent_obj);  /* checked: 0..2^64-1 */
    if (parent == (unsigned long long)-1 && PyErr_Occurred()) goto done;
    if (block_bytes <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_bytes must be positive");
        goto done;
    }
    if (extra.len > 0xffff) {
        PyErr_SetString(PyExc_ValueError, "first_extra is longer than 65,535 bytes");
        goto done;
    }
    Py_ssize_t blocks = data.len / block_bytes;
    result = PyBytes_FromStringAndSize(NULL, blocks * (Py_ssize_t)sizeof(uint64_t));
    if (result == NULL) goto done;
    uint64_t *out = (uint64_t *)PyBytes_AS_STRING(result);
    if (data.len >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        chain(parent, data.buf, blocks, block_bytes, extra.buf, extra.len, out);
        Py_END_ALLOW_THREADS
    } else {
        chain(parent, data.buf, blocks, block_bytes, extra.buf, extra.len, out);
    }
done:
    PyBuffer_Release(&data);
    if (extra.buf != NULL) PyBuffer_Release(&extra);
    return result;
}

static PyMethodDef methods[] = {
    {"chain_hash_bytes", chain_hash_bytes, METH_VARARGS,
     "chain_hash_bytes(parent, data, block_bytes, first_extra=b'') -> bytes of native uint64 "
     "hashes, one per full block (BLAKE2b-64; the GIL is released for long runs)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "protocol._kvhash",
    "Chained BLAKE2b-64 KV block hashes, compiled (protocol.kv_hash).", -1, methods,
};

PyMODINIT_FUNC PyInit__kvhash(void) { return PyModule_Create(&module); }
