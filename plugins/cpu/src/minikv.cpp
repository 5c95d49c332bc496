// MiniKV (ov_kvcrush/methods/minikv.py): heavy hitters chosen once at prefill by cumulative
// attention (or SnapKV's window), pyramid budgets across layers (resolved by Python into the
// per-layer budgets), over the 2-bit store (quant_store.cpp). The selection is importance.cpp's;
// what MiniKV adds is that it is frozen after the prompt, which this policy insists on.
#include "importance.hpp"

namespace ovkc {

namespace {

std::unique_ptr<Policy> make_minikv(Spec& spec, const ModelShape& shape, PolicyCommon common) {
    auto p = std::make_unique<ImportancePolicy>(spec, shape, std::move(common));
    if (!p->frozen) throw Error(Spec::invalid("frozen", "0", "1 (MiniKV selects once, at prefill)"));
    if (p->scoring == Scoring::none) throw Error(Spec::invalid("scoring", "none", "h2o, snapkv"));
    return p;
}

}  // namespace

OVKC_REGISTER_POLICY("minikv", make_minikv);

}  // namespace ovkc
