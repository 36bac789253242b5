// The CPU matmul kernel of `model.cpu_matmul` (model/cpu_matmul.py builds, loads and calls it):
// an XLA FFI handler for C[i] = op(A[i]) @ op(B[i]) in float32, over any leading batch dims,
// with MKL's sequential sgemm doing each product.
//
// Why a kernel of its own: XLA:CPU's matmuls (YNNPACK, or its own Eigen dot) run these shapes
// 10-25% below MKL on a core, and it runs the attention's small batched products on one thread
// (BENCHMARKS.md, "The CPU step"). Here the work (batch entries x blocks of output rows) is split
// over XLA's own intra-op thread pool, so no second pool competes with XLA's threads for the
// cores. The calling thread takes work items itself and only waits for items another thread has
// already started: a helper task the pool has not run yet (every thread busy, say with the other
// half of the batch) finds nothing left when it runs, so the call can never wait on the pool.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

extern "C" void cblas_sgemm(int layout, int trans_a, int trans_b, int m, int n, int k, float alpha,
                            const float* a, int lda, const float* b, int ldb, float beta, float* c,
                            int ldc);
enum { kRowMajor = 101, kNoTrans = 111, kTrans = 112 };

// Output rows per work item at least this many: smaller blocks cost MKL its packing for little.
constexpr int64_t kMinRows = 64;

struct Work {
  const float* a;
  const float* b;
  float* c;
  int64_t m, n, k;
  bool trans_a, trans_b;
  int64_t rows, blocks, items;  // rows per block, blocks per batch entry, entries x blocks
  std::atomic<int64_t> next{0}, done{0};

  void Run() {
    for (int64_t i; (i = next.fetch_add(1)) < items;) {
      const int64_t entry = i / blocks, m0 = (i % blocks) * rows, mi = std::min(rows, m - m0);
      const float* a_i = a + entry * m * k;
      // Rows m0.. of op(A): of A itself, or its columns m0.. when it is stored transposed [k, m].
      const float* a_rows = trans_a ? a_i + m0 : a_i + m0 * k;
      cblas_sgemm(kRowMajor, trans_a ? kTrans : kNoTrans, trans_b ? kTrans : kNoTrans, mi, n, k,
                  1.0f, a_rows, trans_a ? m : k, b + entry * k * n, trans_b ? k : n, 0.0f,
                  c + entry * m * n + m0 * n, n);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

static ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b,
                             ffi::Result<ffi::AnyBuffer> c, bool trans_a, bool trans_b) {
  const auto ad = a.dimensions(), bd = b.dimensions(), cd = c->dimensions();
  const size_t r = ad.size();
  if (a.element_type() != ffi::F32 || b.element_type() != ffi::F32 || c->element_type() != ffi::F32)
    return ffi::Error::InvalidArgument("cpu_matmul: float32 operands only");
  if (r < 2 || bd.size() != r || cd.size() != r)
    return ffi::Error::InvalidArgument("cpu_matmul: operands and result of one rank, at least 2");
  auto w = std::make_shared<Work>();
  int64_t batch = 1;
  for (size_t i = 0; i + 2 < r; ++i) {
    if (bd[i] != ad[i] || cd[i] != ad[i])
      return ffi::Error::InvalidArgument("cpu_matmul: batch dims differ");
    batch *= ad[i];
  }
  w->m = trans_a ? ad[r - 1] : ad[r - 2];
  w->k = trans_a ? ad[r - 2] : ad[r - 1];
  w->n = trans_b ? bd[r - 2] : bd[r - 1];
  if ((trans_b ? bd[r - 1] : bd[r - 2]) != w->k || cd[r - 2] != w->m || cd[r - 1] != w->n)
    return ffi::Error::InvalidArgument("cpu_matmul: operand dims do not match");
  if (std::max({w->m, w->n, w->k}) >= (int64_t{1} << 31))
    return ffi::Error::InvalidArgument("cpu_matmul: a dim over 2^31 (MKL's 32-bit interface)");
  if (batch == 0 || w->m == 0 || w->n == 0) return ffi::Error::Success();
  w->a = a.typed_data<float>();
  w->b = b.typed_data<float>();
  w->c = c->typed_data<float>();
  w->trans_a = trans_a;
  w->trans_b = trans_b;
  // One item per thread at least: a lone product is cut into row blocks, a batch of products
  // (the attention's) split by entry.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t want = (threads + batch - 1) / batch;
  w->blocks = std::max<int64_t>(1, std::min(want, w->m / kMinRows));
  w->rows = (w->m + w->blocks - 1) / w->blocks;
  w->blocks = (w->m + w->rows - 1) / w->rows;
  w->items = batch * w->blocks;
  const int64_t helpers = std::min(threads, w->items) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([w] { w->Run(); });
  w->Run();
  // Only items another thread has taken are left: each finishes in one product's time.
  while (w->done.load(std::memory_order_acquire) < w->items) std::this_thread::yield();
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshlmCpuMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("trans_a")
                                  .Attr<bool>("trans_b"));
