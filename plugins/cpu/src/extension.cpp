// Entry point of the extension library: core.add_extension("libov_kvcrush_cpu.so").
#include <openvino/core/extension.hpp>
#include <openvino/core/op_extension.hpp>

#include "attention_op.hpp"

OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>({std::make_shared<ov::OpExtension<ovkc::PagedAttention>>()}));
