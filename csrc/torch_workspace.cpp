/* torch_workspace.cpp: borrowing torch's cuBLASLt workspace. See torch_workspace.h. */
#include "torch_workspace.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>

namespace {

using GetFn = void *(*)();
using SizeFn = size_t (*)();

// The mangled names of at::cuda::getCUDABlasLtWorkspace() and at::cuda::getCUDABlasLtWorkspaceSize().
constexpr const char *kGetName = "_ZN2at4cuda22getCUDABlasLtWorkspaceEv";
constexpr const char *kSizeName = "_ZN2at4cuda26getCUDABlasLtWorkspaceSizeEv";

// Written once under bind_mutex, then only read: `bound` publishes the pair.
std::mutex bind_mutex;
GetFn get_fn = nullptr;
SizeFn size_fn = nullptr;
std::atomic<bool> bound{false};

}  // namespace

extern "C" int fp8ext_torch_ws_bind(const char *lib_path, char *err, size_t err_len) {
    std::lock_guard<std::mutex> lock(bind_mutex);
    // RTLD_NOLOAD: only a library this process has already loaded (torch's), never new code from a path.
    void *lib = dlopen(lib_path, RTLD_LAZY | RTLD_NOLOAD);
    if (!lib) {
        const char *why = dlerror();
        std::snprintf(err, err_len, "%s is not a library this process has loaded%s%s%s", lib_path, why ? " (" : "",
                      why ? why : "", why ? ")" : "");
        return -1;
    }
    auto get = reinterpret_cast<GetFn>(dlsym(lib, kGetName));
    auto size = reinterpret_cast<SizeFn>(dlsym(lib, kSizeName));
    if (!get || !size) {
        std::snprintf(err, err_len, "%s has no %s (at::cuda::%s)", lib_path, get ? kSizeName : kGetName,
                      get ? "getCUDABlasLtWorkspaceSize()" : "getCUDABlasLtWorkspace()");
        dlclose(lib);
        return -1;
    }
    if (bound.load(std::memory_order_acquire)) {  // bound before: the functions are those of torch's one library
        dlclose(lib);
        return 0;
    }
    // The handle is kept (never closed): the library stays loaded while the pointers into it are used.
    get_fn = get, size_fn = size;
    bound.store(true, std::memory_order_release);
    return 0;
}

extern "C" int fp8ext_torch_ws_bound(void) { return bound.load(std::memory_order_acquire) ? 1 : 0; }

extern "C" int fp8ext_torch_ws_get(void **ptr, size_t *bytes, char *err, size_t err_len) {
    if (!bound.load(std::memory_order_acquire)) {
        std::snprintf(err, err_len, "torch's cuBLASLt workspace functions were not looked up");
        return -1;
    }
    try {
        // The size first: torch's own cuBLASLt calls pair the two the same way.
        const size_t n = size_fn();
        void *p = get_fn();
        *ptr = p, *bytes = n;
        return 0;
    } catch (const std::exception &e) {
        std::snprintf(err, err_len, "%s", e.what());
        // c10::OutOfMemoryError's message; its type is torch's, not visible here
        return std::strstr(e.what(), "out of memory") ? -2 : -1;
    } catch (...) {
        std::snprintf(err, err_len, "an exception that is not a std::exception");
    }
    return -1;
}
