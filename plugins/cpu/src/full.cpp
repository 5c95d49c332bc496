// The full cache (ov_kvcrush/methods/full.py): every token kept, no hook of its own.
#include "policy.hpp"

namespace ovkc {

namespace {

std::unique_ptr<Policy> make_full(Spec& /*spec*/, const ModelShape& /*shape*/, PolicyCommon common) {
    return std::make_unique<Policy>(std::move(common));
}

}  // namespace

OVKC_REGISTER_POLICY("full", make_full);

}  // namespace ovkc
