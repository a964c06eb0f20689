// ssdlib._C.GraphPool: CUDA graphs keyed by an int, captured from Python callables, sharing one
// memory pool, each replayed by its key.
//
//   pool = GraphPool(device, warmup=2, capture_error_mode="thread_local")
//   pool.capture(key, fn)        # fn(): no arguments; `warmup` eager calls, then one captured call
//   pool.replay(key)             # on the caller's current stream
//   pool.has(key); len(pool); pool.clear()
//
// ssdlib/ops/graph_pool.py (NativeGraphPool) maps the engine's hashable keys to these ints and
// holds the Python side of the contract; torch.cuda.graph is the reference for the capture steps.
//
// GIL: held while Python runs (fn) and while the map changes; released around the CUDA calls that
// may block (synchronize, capture begin/end, replay), as torch's own CUDAGraph bindings do.
#include "graph_pool.h"

#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>

namespace py = pybind11;

namespace ssdlib {
namespace {

using Graph = at::cuda::CUDAGraph;
using PoolId = decltype(at::cuda::graph_pool_handle());

cudaStreamCaptureMode capture_mode(const std::string& name) {
  if (name == "global") {
    return cudaStreamCaptureModeGlobal;
  }
  if (name == "thread_local") {
    return cudaStreamCaptureModeThreadLocal;
  }
  if (name == "relaxed") {
    return cudaStreamCaptureModeRelaxed;
  }
  throw py::value_error("GraphPool: capture_error_mode must be 'global', 'thread_local' or 'relaxed', got '" +
                        name + "'");
}

c10::DeviceIndex checked_device(int64_t device) {
  const int64_t count = c10::cuda::device_count();
  if (device < 0 || device >= count) {
    throw py::value_error("GraphPool: device " + std::to_string(device) + " is not one of the " +
                          std::to_string(count) + " CUDA devices");
  }
  return static_cast<c10::DeviceIndex>(device);
}

int64_t checked_warmup(int64_t warmup) {
  if (warmup < 0) {
    throw py::value_error("GraphPool: warmup must be >= 0, got " + std::to_string(warmup));
  }
  return warmup;
}

// Ends a capture that fn broke off; its own error (e.g. an invalidated capture) is dropped so that
// fn's exception is the one the caller sees. Current stream: the capture stream.
void end_capture_quietly(Graph& graph) {
  py::gil_scoped_release no_gil;
  try {
    graph.capture_end();
  } catch (...) {  // NOLINT(bugprone-empty-catch): fn's exception is rethrown by the caller
  }
}

class GraphPool {
 public:
  GraphPool(int64_t device, int64_t warmup, const std::string& mode)
      : device_(checked_device(device)),
        warmup_(checked_warmup(warmup)),
        mode_(capture_mode(mode)),
        mempool_(at::cuda::graph_pool_handle()),
        // One side stream for every warm-up and capture: graphs that share a memory pool should
        // also share the capture stream (torch.cuda.graph's advice), and captures cannot use the
        // legacy default stream.
        stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_)) {}

  GraphPool(const GraphPool&) = delete;
  GraphPool& operator=(const GraphPool&) = delete;

  void capture(int64_t key, const py::function& fn) {
    if (graphs_.count(key) != 0) {
      throw py::value_error("GraphPool: key " + std::to_string(key) + " is already captured");
    }
    c10::cuda::CUDAGuard device_guard(device_);
    synchronize();  // the side stream starts after what the caller queued (e.g. static inputs)
    c10::cuda::CUDAStreamGuard on_side_stream(stream_);
    // Warm-up outside the capture: lazy initialisation (cuBLAS workspaces, NCCL communicators,
    // autotuning) must not happen inside it.
    for (int64_t i = 0; i < warmup_; ++i) {
      fn();
    }
    synchronize();  // as torch.cuda.graph: nothing in flight when the capture begins
    auto graph = std::make_unique<Graph>();
    {
      py::gil_scoped_release no_gil;
      graph->capture_begin(mempool_, mode_);
    }
    try {
      fn();
    } catch (...) {
      end_capture_quietly(*graph);
      graph.reset();
      // The failed graph held the only reference to the memory pool when no graph was captured
      // before it: the allocator then frees the pool, and a capture into the same id hit
      // "use_count > 0 INTERNAL ASSERT FAILED" (nvidia-h200-x2, torch 2.11, session 7). Later
      // captures take a fresh pool then; with graphs alive the pool lives on and stays shared.
      if (graphs_.empty()) {
        mempool_ = at::cuda::graph_pool_handle();
      }
      throw;
    }
    {
      py::gil_scoped_release no_gil;
      graph->capture_end();  // instantiates the graph
    }
    graphs_.emplace(key, std::move(graph));
  }

  bool has(int64_t key) const { return graphs_.count(key) != 0; }

  size_t size() const { return graphs_.size(); }

  void replay(int64_t key) {
    Graph& graph = find(key);
    py::gil_scoped_release no_gil;
    graph.replay();
  }

  // Drops every graph after the device is idle (no replay may still use their memory). The next
  // captures get a fresh pool id: the old pool is released once its last graph is gone.
  void clear() {
    auto doomed = std::move(graphs_);
    graphs_.clear();
    mempool_ = at::cuda::graph_pool_handle();
    synchronize();
    py::gil_scoped_release no_gil;
    doomed.clear();
  }

  int64_t device() const { return device_; }

 private:
  // Waits for all work on the pool's device, without holding the GIL.
  void synchronize() const {
    py::gil_scoped_release no_gil;
    c10::cuda::CUDAGuard device_guard(device_);
    c10::cuda::device_synchronize();
  }

  Graph& find(int64_t key) {
    const auto it = graphs_.find(key);
    if (it == graphs_.end()) {
      throw py::key_error("GraphPool: no graph captured for key " + std::to_string(key));
    }
    return *it->second;
  }

  c10::DeviceIndex device_;
  int64_t warmup_;
  cudaStreamCaptureMode mode_;
  PoolId mempool_;
  c10::cuda::CUDAStream stream_;
  std::unordered_map<int64_t, std::unique_ptr<Graph>> graphs_;
};

}  // namespace

void bind_graph_pool(py::module_& m) {
  py::class_<GraphPool>(m, "GraphPool",
                        "CUDA graphs keyed by int, captured from Python callables, sharing one memory pool.")
      .def(py::init<int64_t, int64_t, const std::string&>(), py::arg("device"), py::arg("warmup") = 2,
           py::arg("capture_error_mode") = "thread_local")
      .def("capture", &GraphPool::capture, py::arg("key"), py::arg("fn"),
           "Run fn() `warmup` times on the pool's side stream, then capture one call of it.")
      .def("has", &GraphPool::has, py::arg("key"))
      .def("replay", &GraphPool::replay, py::arg("key"), "Replay one graph on the current stream.")
      .def("clear", &GraphPool::clear, "Synchronize the device and drop every graph.")
      .def("__len__", &GraphPool::size)
      .def_property_readonly("device", &GraphPool::device);
}

}  // namespace ssdlib
