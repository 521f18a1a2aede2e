// Python bindings of the compute ops release the GIL while the op runs (pybind11's call guard,
// after the arguments are converted): the ops touch no Python object, and a worker's asyncio
// thread (gRPC streams, request admission) can then run while the engine thread is inside a
// decode step's GEMVs and attention instead of waiting for them, as it already may during
// torch's own ops (which release the GIL).
#pragma once
#include <torch/extension.h>

#define BATON_RELEASE_GIL pybind11::call_guard<pybind11::gil_scoped_release>()
