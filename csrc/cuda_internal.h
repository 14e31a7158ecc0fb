// Constructors shared between the cuda_*.cu files.
#pragma once

#include <memory>

#include "cuda_paths.h"

namespace dpp {

std::unique_ptr<CudaSendPath> make_staged_send_path(const ShmSender& sender, int device);

}  // namespace dpp
