// CUDA stand-ins for the CPU rehearsal (minirl/rehearse.py): loaded with LD_PRELOAD before torch, so a
// CPU-only torch can run a model's forward and backward on fake "cuda" tensors (no storage, no kernels).
// A CPU build of torch registers no CUDA device guard and no CUDA hooks, and FakeTensorMode needs both:
// the guard to switch the current device around an op, the hooks to say CUDA is built, has devices, and
// has a primary context (autograd's engine asks before running a CUDA backward).
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace {
using Guard = c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>;

struct FakeCUDAHooks final : at::CUDAHooksInterface {
  explicit FakeCUDAHooks(at::CUDAHooksArgs) {}
  void init() const override {}
  bool isBuilt() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return c10::impl::kFakeGuardImplMaxDevices; }
  int getNumGPUs() const override { return c10::impl::kFakeGuardImplMaxDevices; }
  c10::DeviceIndex current_device() const override { return Guard::getDeviceIndex(); }
  c10::DeviceIndex getCurrentDevice() const override { return Guard::getDeviceIndex(); }
};
}  // namespace

C10_REGISTER_GUARD_IMPL(CUDA, Guard);

namespace at {
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", FakeCUDAHooks);
}
