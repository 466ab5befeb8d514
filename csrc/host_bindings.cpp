// The CPU ops library as a Python module: the host-side draft ops bound for the decoding loop's per-step calls
// (host_ops.h says why), each bound in its own source file beside its torch op registration.

#include "host_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lookahead's host-side draft ops (the torch.ops.lookahead_draft functions, called with less overhead)";
  draft_tree::bind_host(m);
  pack_step::bind_host(m);
  suffix_match::bind_host(m);
  accept_trials::bind_host(m);
}
