/* What a foreign trainer interoperates with, from plain C: events and DLPack.
 *   - events: an unrecorded event is complete; a copy on one stream, an event
 *     recorded behind it, a second stream waiting for it and copying on: the
 *     second copy sees the first's bytes; query and synchronize; refusals
 *     (NULL, another engine's stream, a dead handle after the engine);
 * DLPack through the C API, as a consumer that includes
 * dlpack.h would (the structs below are DLPack's unversioned ABI, declared
 * here from its specification; python/tests check the real exchange with
 * torch.from_dlpack / to_dlpack):
 *   - strata_engine_param_dlpack of a held parameter: kDLCPU, the compute
 *     dtype, the shape, compact strides, the acquire pointer; refused when the
 *     group is not held; its deleter frees it;
 *   - strata_engine_reduce_grad_dlpack takes ownership: the deleter is called
 *     exactly once, by the step (or discard_step, or destroy), and the weights
 *     equal those of strata_engine_reduce_grad with a plain pointer;
 *   - wrong device, dtype, shape and strides are refused naming the field,
 *     and the caller keeps the tensor (no deleter call).
 * Exit status 0 = pass. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "c_check.h"
#include "strata/strata.h"

typedef struct {
  int32_t device_type, device_id;
} DLDevice;
typedef struct {
  uint8_t code, bits;
  uint16_t lanes;
} DLDataType;
typedef struct {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
} DLTensor;
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(struct DLManagedTensor* self);
};
typedef struct DLManagedTensor DLManagedTensor;
enum { kDLCPU = 1, kDLCUDA = 2, kDLFloat = 2, kDLInt = 0, kDLBfloat = 4 };


enum { ROWS = 3, COLS = 4, N = ROWS * COLS };

/* A caller's gradient: a managed tensor over its own array; the deleter
 * counts its calls. */
typedef struct {
  DLManagedTensor m;
  int64_t shape[2], strides[2];
  float data[N];
  int deleted;
} Grad;
static void grad_deleter(DLManagedTensor* self) { ((Grad*)self->manager_ctx)->deleted++; }
static void make_grad(Grad* g, float scale) {
  memset(g, 0, sizeof(*g));
  for (int i = 0; i < N; ++i) g->data[i] = scale * (float)(i - 5);
  g->shape[0] = ROWS;
  g->shape[1] = COLS;
  g->strides[0] = COLS;
  g->strides[1] = 1;
  g->m.dl_tensor.data = g->data;
  g->m.dl_tensor.device.device_type = kDLCPU;
  g->m.dl_tensor.ndim = 2;
  g->m.dl_tensor.dtype.code = kDLFloat;
  g->m.dl_tensor.dtype.bits = 32;
  g->m.dl_tensor.dtype.lanes = 1;
  g->m.dl_tensor.shape = g->shape;
  g->m.dl_tensor.strides = g->strides;
  g->m.manager_ctx = g;
  g->m.deleter = grad_deleter;
}

static int make_engine(strata_engine_t* e, strata_stream_t* s) {
  strata_param_desc_t d[2];
  memset(d, 0, sizeof(d));
  const char* names[2] = {"a.weight", "b.weight"};
  for (int p = 0; p < 2; ++p) {
    d[p].struct_size = sizeof(strata_param_desc_t);
    d[p].name = names[p];
    d[p].group = names[p];
    d[p].ndim = 2;
    d[p].shape[0] = ROWS;
    d[p].shape[1] = COLS;
    d[p].dtype = STRATA_DTYPE_F32;
  }
  strata_engine_options_t opts;
  OK(NULL, strata_engine_options_init(&opts));
  opts.config_json =
      "{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.01}}, \"zero_optimization\": {\"stage\": 3, "
      "\"offload_param\": {\"device\": \"cpu\"}, \"offload_optimizer\": {\"device\": \"cpu\"}}, "
      "\"strata\": {\"device_memory\": 67108864, \"device_reserve\": 0}}";
  opts.device_kind = STRATA_DEVICE_HOST;
  OK(NULL, strata_engine_create(&opts, d, 2, e));
  OK(*e, strata_stream_create(*e, "caller", s));
  float w[N];
  for (int i = 0; i < N; ++i) w[i] = 0.1f * (float)i;
  OK(*e, strata_engine_load_param(*e, 0, w, STRATA_DTYPE_F32, N));
  OK(*e, strata_engine_load_param(*e, 1, w, STRATA_DTYPE_F32, N));
  return 0;
}

static int test_export(void) {
  strata_engine_t e;
  strata_stream_t s;
  if (make_engine(&e, &s)) return -1;
  DLManagedTensor* t = NULL;
  CHECK(strata_engine_param_dlpack(e, 0, &t) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_engine_last_error(e), "not acquired") != NULL);
  CHECK(strata_engine_param_dlpack(e, 7, &t) == STRATA_ERR_INVALID_ARGUMENT);
  void* ptr = NULL;
  size_t count = 0;
  OK(e, strata_engine_acquire(e, 0, s, &ptr, 1, &count));
  OK(e, strata_engine_param_dlpack(e, 0, &t));
  CHECK(t->dl_tensor.data == ptr && t->dl_tensor.byte_offset == 0);
  CHECK(t->dl_tensor.device.device_type == kDLCPU && t->dl_tensor.device.device_id == 0);
  CHECK(t->dl_tensor.dtype.code == kDLFloat && t->dl_tensor.dtype.bits == 32 && t->dl_tensor.dtype.lanes == 1);
  CHECK(t->dl_tensor.ndim == 2 && t->dl_tensor.shape[0] == ROWS && t->dl_tensor.shape[1] == COLS);
  CHECK(t->dl_tensor.strides && t->dl_tensor.strides[0] == COLS && t->dl_tensor.strides[1] == 1);
  OK(e, strata_stream_synchronize(s));
  CHECK(((const float*)t->dl_tensor.data)[5] == 0.5f);
  t->deleter(t);
  OK(e, strata_engine_release(e, 0, s));
  strata_stream_destroy(s);
  strata_engine_destroy(e);
  return 0;
}

static int test_reduce(void) {
  /* Engine A: plain pointers; engine B: DLPack tensors. Two steps each. */
  strata_engine_t a, b;
  strata_stream_t sa, sb;
  if (make_engine(&a, &sa) || make_engine(&b, &sb)) return -1;
  Grad g[2][2];
  for (int step = 0; step < 2; ++step) {
    OK(a, strata_engine_begin_micro_batch(a, 1));
    OK(b, strata_engine_begin_micro_batch(b, 1));
    for (int p = 0; p < 2; ++p) {
      make_grad(&g[step][p], 0.01f * (float)(p + 1 + step));
      OK(a, strata_engine_reduce_grad(a, (uint32_t)p, g[step][p].data, STRATA_DTYPE_F32, sa));
      OK(b, strata_engine_reduce_grad_dlpack(b, (uint32_t)p, &g[step][p].m, sb));
    }
    OK(a, strata_engine_step(a, -1, NULL));
    OK(b, strata_engine_step(b, -1, NULL));
    for (int p = 0; p < 2; ++p) CHECK(g[step][p].deleted == 1); /* given back by the step, once */
  }
  float wa[N], wb[N];
  for (int p = 0; p < 2; ++p) {
    OK(a, strata_engine_read_param(a, (uint32_t)p, wa, STRATA_DTYPE_F32, N));
    OK(b, strata_engine_read_param(b, (uint32_t)p, wb, STRATA_DTYPE_F32, N));
    CHECK(memcmp(wa, wb, sizeof(wa)) == 0);
  }

  /* Refusals: named, and the caller keeps the tensor. */
  Grad bad;
  OK(b, strata_engine_begin_micro_batch(b, 1));
  make_grad(&bad, 1);
  bad.m.dl_tensor.device.device_type = kDLCUDA;
  CHECK(strata_engine_reduce_grad_dlpack(b, 0, &bad.m, sb) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_engine_last_error(b), "kDLCUDA") != NULL);
  make_grad(&bad, 1);
  bad.m.dl_tensor.dtype.code = kDLInt;
  CHECK(strata_engine_reduce_grad_dlpack(b, 0, &bad.m, sb) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_engine_last_error(b), "dtype") != NULL);
  make_grad(&bad, 1);
  bad.shape[0] = COLS;
  bad.shape[1] = ROWS;
  CHECK(strata_engine_reduce_grad_dlpack(b, 0, &bad.m, sb) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_engine_last_error(b), "shape [4, 3], the parameter [3, 4]") != NULL);
  make_grad(&bad, 1);
  bad.strides[0] = 1; /* a transposed view */
  bad.strides[1] = ROWS;
  CHECK(strata_engine_reduce_grad_dlpack(b, 0, &bad.m, sb) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_engine_last_error(b), "not contiguous") != NULL);
  make_grad(&bad, 1);
  bad.m.dl_tensor.byte_offset = UINT64_C(0xC000000000000000); /* past the end of the address space */
  CHECK(strata_engine_reduce_grad_dlpack(b, 0, &bad.m, sb) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_engine_last_error(b), "byte_offset") != NULL);
  make_grad(&bad, 1);
  bad.m.dl_tensor.byte_offset = 1; /* misaligned for float32 */
  CHECK(strata_engine_reduce_grad_dlpack(b, 0, &bad.m, sb) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_engine_last_error(b), "misaligned") != NULL);
  CHECK(bad.deleted == 0);

  /* A gradient the engine holds when the step is discarded, and one it
   * holds when the engine is destroyed: each given back once. */
  Grad held, at_exit;
  make_grad(&held, 1);
  OK(b, strata_engine_reduce_grad_dlpack(b, 0, &held.m, sb));
  OK(b, strata_engine_discard_step(b, NULL));
  CHECK(held.deleted == 1);
  OK(b, strata_engine_begin_micro_batch(b, 1));
  make_grad(&at_exit, 1);
  OK(b, strata_engine_reduce_grad_dlpack(b, 1, &at_exit.m, sb));
  strata_stream_destroy(sa);
  strata_engine_destroy(a);
  strata_engine_destroy(b);
  strata_stream_destroy(sb);
  CHECK(at_exit.deleted == 1);
  return 0;
}

static int test_events(void) {
  strata_engine_t e, other;
  strata_stream_t s1, s2, so;
  if (make_engine(&e, &s1) || make_engine(&other, &so)) return -1;
  OK(e, strata_stream_create(e, "second", &s2));
  strata_event_t ev;
  OK(e, strata_event_create(e, &ev));
  int done = 0;
  OK(e, strata_event_query(ev, &done));
  CHECK(done == 1); /* never recorded */
  enum { BYTES = 16 << 20 };
  unsigned char* src = malloc(BYTES);
  unsigned char* out = malloc(BYTES);
  if (!src || !out) return -1;
  for (size_t i = 0; i < BYTES; ++i) src[i] = (unsigned char)(i * 7 + 3);
  memset(out, 0, BYTES);
  void *d1, *d2;
  OK(e, strata_device_alloc(e, BYTES, &d1));
  OK(e, strata_device_alloc(e, BYTES, &d2));
  for (int round = 0; round < 3; ++round) {
    OK(e, strata_memcpy_async(d1, src, BYTES, STRATA_COPY_HOST_TO_DEVICE, s1));
    OK(e, strata_event_record(ev, s1));
    OK(e, strata_stream_wait_event(s2, ev));
    OK(e, strata_memcpy_async(d2, d1, BYTES, STRATA_COPY_DEVICE_TO_DEVICE, s2));
    OK(e, strata_memcpy_async(out, d2, BYTES, STRATA_COPY_DEVICE_TO_HOST, s2));
    OK(e, strata_stream_synchronize(s2));
    CHECK(memcmp(out, src, BYTES) == 0);
    OK(e, strata_event_synchronize(ev));
    OK(e, strata_event_query(ev, &done));
    CHECK(done == 1);
    for (size_t i = 0; i < BYTES; ++i) src[i] = (unsigned char)(src[i] + 1);
  }
  CHECK(strata_event_record(NULL, s1) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strata_event_record(ev, NULL) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strata_event_record(ev, so) == STRATA_ERR_INVALID_ARGUMENT); /* another engine's stream */
  CHECK(strstr(strata_engine_last_error(e), "another engine") != NULL);
  CHECK(strata_event_query(ev, NULL) == STRATA_ERR_INVALID_ARGUMENT);
  OK(e, strata_device_free(e, d1, NULL));
  OK(e, strata_device_free(e, d2, NULL));
  free(src);
  free(out);
  /* An event outliving its engine is dead, and still freed by destroy. */
  strata_event_t orphan;
  OK(other, strata_event_create(other, &orphan));
  strata_stream_destroy(so);
  strata_engine_destroy(other);
  CHECK(strata_event_query(orphan, &done) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "destroyed") != NULL);
  CHECK(strata_event_destroy(orphan) == STRATA_OK);
  CHECK(strata_event_destroy(ev) == STRATA_OK);
  strata_stream_destroy(s1);
  strata_stream_destroy(s2);
  strata_engine_destroy(e);
  return 0;
}

int main(void) {
  test_events();
  test_export();
  test_reduce();
  return check_summary("engine interop C test (events, DLPack)");
}
