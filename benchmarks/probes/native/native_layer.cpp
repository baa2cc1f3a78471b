// The floor of a native per-layer path (probe, not library code): fusekit plans, deserialized from
// the bytes fusekit stores, executed from C++ by one torch extension call that also allocates the
// output (run), and a convolution whose autograd node is C++ too (conv). Compared with fusekit's
// Python path and PyTorch eager by probe_native_layer.py.
#include <torch/extension.h>

#include <dlfcn.h>
#include <execinfo.h>
#include <csignal>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include <cudnn_frontend.h>

namespace fe = cudnn_frontend;

// With NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING the frontend reaches cuDNN through this handle (the
// Python package sets its own in its compiled module; an extension sets its own: open_cudnn).
void *cudnn_frontend::cudnn_dlhandle = nullptr;

namespace {

// A crash inside the frontend prints the native frames (the probe's only debugger on the lent machine).
void on_segv(int sig) {
    void *frames[64];
    int n = backtrace(frames, 64);
    std::fprintf(stderr, "native_layer: signal %d, native frames:\n", sig);
    backtrace_symbols_fd(frames, n, 2);
    std::signal(sig, SIG_DFL);
    std::raise(sig);
}

// The libcudnn this process already has (by soname), else the one at ``path``. Returns its soname or path.
std::string open_cudnn(std::string path) {
    if (cudnn_frontend::cudnn_dlhandle == nullptr) {
        cudnn_frontend::cudnn_dlhandle = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_NOLOAD);
        std::signal(SIGSEGV, on_segv);
        if (cudnn_frontend::cudnn_dlhandle != nullptr) return "libcudnn.so.9 (already loaded)";
        cudnn_frontend::cudnn_dlhandle = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
        TORCH_CHECK(cudnn_frontend::cudnn_dlhandle != nullptr, "native_layer: cannot open ", path, ": ", dlerror());
    }
    return path;
}

struct Loaded {
    std::shared_ptr<fe::graph::Graph> graph;
    std::vector<int64_t> order;  // position in the call's (operands..., output) of each slot, ascending uid
    int64_t workspace = 0;
};

std::vector<Loaded> loaded;

// Deserialize ``blob`` (fusekit's stored plan bytes) on the cuDNN handle ``handle``; ``uids``: the
// plan's tensor uids in fusekit's order (operands, then outputs). Returns an id for run().
int64_t load(int64_t handle, py::bytes blob, std::vector<int64_t> uids, bool warmup) {
    TORCH_CHECK(cudnn_frontend::cudnn_dlhandle != nullptr, "native_layer: call open_cudnn first");
    std::string s = blob;
    std::vector<uint8_t> data(s.begin(), s.end());
    auto g = std::make_shared<fe::graph::Graph>();
    auto st = g->deserialize(reinterpret_cast<cudnnHandle_t>(handle), data, false, warmup);
    TORCH_CHECK(st.is_good(), "native_layer: deserialize failed: ", st.get_message());
    Loaded l;
    l.graph = g;
    l.order.resize(uids.size());
    std::iota(l.order.begin(), l.order.end(), 0);
    std::sort(l.order.begin(), l.order.end(), [&](int64_t a, int64_t b) { return uids[a] < uids[b]; });
    st = g->get_workspace_size(l.workspace);
    TORCH_CHECK(st.is_good(), "native_layer: workspace size: ", st.get_message());
    loaded.push_back(std::move(l));
    return static_cast<int64_t>(loaded.size()) - 1;
}

// Run plan ``id`` on ``operands`` into a new channels-last output of ``shape`` (the layer's forward:
// allocation and execute, no key, no Python between them).
torch::Tensor run(int64_t id, int64_t handle, std::vector<torch::Tensor> operands, std::vector<int64_t> shape,
                  int64_t workspace) {
    auto const &l = loaded.at(id);
    auto y = at::empty(shape, operands[0].options().memory_format(at::MemoryFormat::ChannelsLast));
    void *ptrs[16];
    size_t n = operands.size() + 1;
    TORCH_CHECK(n == l.order.size() && n <= 16, "native_layer: expected ", l.order.size() - 1, " operands");
    for (size_t i = 0; i < n; ++i) {
        auto p = static_cast<size_t>(l.order[i]);
        ptrs[i] = p < operands.size() ? operands[p].data_ptr() : y.data_ptr();
    }
    auto st = l.graph->execute(reinterpret_cast<cudnnHandle_t>(handle), ptrs, static_cast<int>(n),
                               reinterpret_cast<void *>(workspace));
    TORCH_CHECK(st.is_good(), "native_layer: execute failed: ", st.get_message());
    return y;
}

int64_t workspace_size(int64_t id) { return loaded.at(id).workspace; }

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// A convolution layer's training host path in C++: forward runs plan ids[0] (conv: x, w -> y) and
// keeps x and w; backward runs ids[1] (conv_dgrad: dy, w -> dx) and ids[2] (conv_wgrad: x, dy -> dw).
struct Conv : public torch::autograd::Function<Conv> {
    static torch::Tensor forward(AutogradContext *ctx, torch::Tensor x, torch::Tensor w, std::vector<int64_t> ids,
                                 int64_t handle, int64_t workspace, std::vector<int64_t> y_shape) {
        ctx->save_for_backward({x, w});
        ctx->saved_data["ids"] = ids;
        ctx->saved_data["handle"] = handle;
        ctx->saved_data["workspace"] = workspace;
        return run(ids[0], handle, {x, w}, y_shape, workspace);
    }

    static tensor_list backward(AutogradContext *ctx, tensor_list grads) {
        auto saved = ctx->get_saved_variables();
        auto x = saved[0], w = saved[1];
        auto dy = grads[0].contiguous(at::MemoryFormat::ChannelsLast);
        auto ids = ctx->saved_data["ids"].toIntVector();
        auto handle = ctx->saved_data["handle"].toInt(), workspace = ctx->saved_data["workspace"].toInt();
        auto dx = run(ids[1], handle, {dy, w}, x.sizes().vec(), workspace);
        auto dw = run(ids[2], handle, {x, dy}, w.sizes().vec(), workspace);
        return {dx, dw, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
    }
};

torch::Tensor conv(torch::Tensor x, torch::Tensor w, std::vector<int64_t> ids, int64_t handle, int64_t workspace,
                   std::vector<int64_t> y_shape) {
    return Conv::apply(x, w, ids, handle, workspace, y_shape);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("open_cudnn", &open_cudnn, "reach the process's libcudnn (else open the one at path)");
    m.def("load", &load, "deserialize a fusekit plan blob");
    m.def("run", &run, "allocate the output and execute a loaded plan");
    m.def("workspace_size", &workspace_size, "the loaded plan's workspace bytes");
    m.def("conv", &conv, "a convolution with autograd: forward and backward through loaded plans");
}
