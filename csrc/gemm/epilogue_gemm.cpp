// megatron.trainer.kernels._gemm_epilogues: cuBLASLt matrix products whose epilogue applies the
// bias and the (tanh) GeLU forward, or the GeLU derivative backward, so that the MLP's
// activation costs no pass of its own over the [tokens, ffn] tensors.
//
// Plain pybind11 over raw addresses: megatron/trainer/kernels/gemm_epilogues.py checks the tensors
// (dtype, device, layout, alignment) and allocates outputs and workspace; this file only
// describes the product to cuBLASLt, picks its algorithm once per shape and launches it.
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

namespace py = pybind11;

namespace {

// A cuBLASLt call that failed, with its status name and code.
class CublasLtError : public std::runtime_error {
 public:
  CublasLtError(const std::string& what, cublasStatus_t status)
      : std::runtime_error("cuBLASLt " + what + " failed: " + cublasLtGetStatusName(status) +
                           " (status " + std::to_string(static_cast<int>(status)) + ")") {}
};

void check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) throw CublasLtError(what, status);
}

// The owned cuBLASLt handle.
class Handle {
 public:
  Handle() { check(cublasLtCreate(&handle_), "cublasLtCreate"); }
  ~Handle() { cublasLtDestroy(handle_); }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  cublasLtHandle_t get() const { return handle_; }

 private:
  cublasLtHandle_t handle_ = nullptr;
};

// A column-major matrix layout.
class Layout {
 public:
  Layout(cudaDataType_t type, uint64_t rows, uint64_t columns, int64_t leading) {
    check(cublasLtMatrixLayoutCreate(&layout_, type, rows, columns, leading),
          "cublasLtMatrixLayoutCreate");
  }
  ~Layout() { cublasLtMatrixLayoutDestroy(layout_); }
  Layout(const Layout&) = delete;
  Layout& operator=(const Layout&) = delete;
  cublasLtMatrixLayout_t get() const { return layout_; }

 private:
  cublasLtMatrixLayout_t layout_ = nullptr;
};

// The operation: fp32 accumulation, transposes and epilogue fixed; the bias and auxiliary
// pointers change per call.
class Operation {
 public:
  Operation(cublasOperation_t transa, cublasOperation_t transb, cublasLtEpilogue_t epilogue,
            int64_t aux_leading) {
    check(cublasLtMatmulDescCreate(&desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F),
          "cublasLtMatmulDescCreate");
    set(CUBLASLT_MATMUL_DESC_TRANSA, transa);
    set(CUBLASLT_MATMUL_DESC_TRANSB, transb);
    set(CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
    set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, aux_leading);
  }
  ~Operation() { cublasLtMatmulDescDestroy(desc_); }
  Operation(const Operation&) = delete;
  Operation& operator=(const Operation&) = delete;

  template <typename T>
  void set(cublasLtMatmulDescAttributes_t attribute, const T& value) {
    check(cublasLtMatmulDescSetAttribute(desc_, attribute, &value, sizeof(value)),
          "cublasLtMatmulDescSetAttribute");
  }
  cublasLtMatmulDesc_t get() const { return desc_; }

 private:
  cublasLtMatmulDesc_t desc_ = nullptr;
};

// Search preferences: the workspace cap and the operands' actual alignments (the default
// assumes 256 bytes; parameters packed in a buffer may sit at 128).
class Preference {
 public:
  Preference(uint64_t workspace_bytes, uint32_t align_a, uint32_t align_b, uint32_t align_d) {
    check(cublasLtMatmulPreferenceCreate(&pref_), "cublasLtMatmulPreferenceCreate");
    set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace_bytes);
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a);
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b);
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_d);
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d);
  }
  ~Preference() { cublasLtMatmulPreferenceDestroy(pref_); }
  Preference(const Preference&) = delete;
  Preference& operator=(const Preference&) = delete;
  cublasLtMatmulPreference_t get() const { return pref_; }

 private:
  template <typename T>
  void set(cublasLtMatmulPreferenceAttributes_t attribute, const T& value) {
    check(cublasLtMatmulPreferenceSetAttribute(pref_, attribute, &value, sizeof(value)),
          "cublasLtMatmulPreferenceSetAttribute");
  }
  cublasLtMatmulPreference_t pref_ = nullptr;
};

// Everything cuBLASLt needs for one shape, with the algorithm its heuristic chose.
struct Plan {
  Plan(cublasLtHandle_t handle, cudaDataType_t type, cublasOperation_t transa,
       cublasOperation_t transb, cublasLtEpilogue_t epilogue, uint64_t m, uint64_t n,
       uint64_t k, int64_t lda, int64_t ldb, int64_t ldd, uint64_t workspace_bytes,
       uint32_t align_a, uint32_t align_b, uint32_t align_d)
      : operation(transa, transb, epilogue, ldd),
        a(type, transa == CUBLAS_OP_N ? m : k, transa == CUBLAS_OP_N ? k : m, lda),
        b(type, transb == CUBLAS_OP_N ? k : n, transb == CUBLAS_OP_N ? n : k, ldb),
        d(type, m, n, ldd) {
    Preference preference(workspace_bytes, align_a, align_b, align_d);
    int found = 0;
    check(cublasLtMatmulAlgoGetHeuristic(handle, operation.get(), a.get(), b.get(), d.get(),
                                         d.get(), preference.get(), 1, &heuristic, &found),
          "cublasLtMatmulAlgoGetHeuristic");
    if (found == 0) {
      throw std::runtime_error("cuBLASLt has no algorithm for this epilogue GEMM (m=" +
                               std::to_string(m) + ", n=" + std::to_string(n) +
                               ", k=" + std::to_string(k) + ")");
    }
  }

  Operation operation;
  Layout a, b, d;
  cublasLtMatmulHeuristicResult_t heuristic{};
};

cudaDataType_t data_type(int code) {
  switch (code) {
    case 0: return CUDA_R_16BF;
    case 1: return CUDA_R_16F;
    case 2: return CUDA_R_32F;
    default:
      throw std::invalid_argument(
          "epilogue GEMM: dtype code must be 0 (bf16), 1 (fp16) or 2 (fp32)");
  }
}

// D = epilogue(op(A) op(B)) in cuBLASLt's column-major terms; plans are cached per shape.
// Not thread-safe: one object per thread (the trainer calls it from its one Python thread).
class EpilogueGemm {
 public:
  // D = gelu(op(A) op(B) + bias); aux = op(A) op(B) + bias, laid out like D.
  void gelu_aux_bias(int dtype, bool transa, bool transb, uint64_t m, uint64_t n, uint64_t k,
                     uintptr_t a, int64_t lda, uintptr_t b, int64_t ldb, uintptr_t d,
                     int64_t ldd, uintptr_t bias, uintptr_t aux, uintptr_t workspace,
                     uint64_t workspace_bytes, uintptr_t stream) {
    run(CUBLASLT_EPILOGUE_GELU_AUX_BIAS, dtype, transa, transb, m, n, k, a, lda, b, ldb, d, ldd,
        bias, aux, workspace, workspace_bytes, stream);
  }

  // D = op(A) op(B) * gelu'(aux). (cuBLASLt's DGELU_BGRAD, which also sums the bias
  // gradient, took 498 against 288 us for GEMM + Triton on the H200's fc2 shape.)
  void dgelu(int dtype, bool transa, bool transb, uint64_t m, uint64_t n, uint64_t k,
             uintptr_t a, int64_t lda, uintptr_t b, int64_t ldb, uintptr_t d, int64_t ldd,
             uintptr_t aux, uintptr_t workspace, uint64_t workspace_bytes, uintptr_t stream) {
    run(CUBLASLT_EPILOGUE_DGELU, dtype, transa, transb, m, n, k, a, lda, b, ldb, d, ldd, 0, aux,
        workspace, workspace_bytes, stream);
  }

  size_t plans() const { return plans_.size(); }

 private:
  using Key = std::tuple<int, int, bool, bool, uint64_t, uint64_t, uint64_t, int64_t, int64_t,
                         int64_t, uint64_t, uint32_t, uint32_t, uint32_t>;

  static uint32_t alignment(uintptr_t address) {
    uint32_t bytes = 256;
    while (bytes > 1 && address % bytes != 0) bytes /= 2;
    return bytes;
  }

  void run(cublasLtEpilogue_t epilogue, int dtype, bool transa, bool transb, uint64_t m,
           uint64_t n, uint64_t k, uintptr_t a, int64_t lda, uintptr_t b, int64_t ldb,
           uintptr_t d, int64_t ldd, uintptr_t bias, uintptr_t aux, uintptr_t workspace,
           uint64_t workspace_bytes, uintptr_t stream) {
    const cudaDataType_t type = data_type(dtype);
    const cublasOperation_t op_a = transa ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_b = transb ? CUBLAS_OP_T : CUBLAS_OP_N;
    const Key key{static_cast<int>(epilogue), dtype, transa, transb, m, n, k, lda, ldb, ldd,
                  workspace_bytes, alignment(a), alignment(b), alignment(d)};
    auto found = plans_.find(key);
    if (found == plans_.end()) {
      auto plan = std::make_unique<Plan>(handle_.get(), type, op_a, op_b, epilogue, m, n, k,
                                         lda, ldb, ldd, workspace_bytes, alignment(a),
                                         alignment(b), alignment(d));
      found = plans_.emplace(key, std::move(plan)).first;
    }
    Plan& plan = *found->second;
    if (bias != 0) {
      plan.operation.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, reinterpret_cast<void*>(bias));
    }
    plan.operation.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, reinterpret_cast<void*>(aux));
    const float one = 1.0f, zero = 0.0f;
    void* output = reinterpret_cast<void*>(d);
    check(cublasLtMatmul(handle_.get(), plan.operation.get(), &one,
                         reinterpret_cast<const void*>(a), plan.a.get(),
                         reinterpret_cast<const void*>(b), plan.b.get(), &zero, output,
                         plan.d.get(), output, plan.d.get(), &plan.heuristic.algo,
                         reinterpret_cast<void*>(workspace), workspace_bytes,
                         reinterpret_cast<cudaStream_t>(stream)),
          "cublasLtMatmul");
  }

  Handle handle_;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "cuBLASLt GEMMs with the bias-GeLU forward and GeLU-gradient epilogues";
  py::class_<EpilogueGemm>(m, "EpilogueGemm")
      .def(py::init<>())
      .def("gelu_aux_bias", &EpilogueGemm::gelu_aux_bias)
      .def("dgelu", &EpilogueGemm::dgelu)
      .def_property_readonly("plans", &EpilogueGemm::plans);
}
