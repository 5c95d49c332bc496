// A method spec as the Python side sends it: "key=value;key=value", lists comma-separated.
//
// The reference configs (ov_kvcrush/methods/) are the single source of every default: Python
// resolves everything (per-layer budgets, KVCrush's anchors drawn with the reference's generator)
// and sends every field a policy reads (ov_kvcrush/method_spec.py and each config's op_fields).
// So a Spec has no defaults: a policy takes each field it needs once, with its allowed range; a
// missing field, a bad value and a field no policy read are each an error naming the field.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <map>
#include <string>
#include <vector>

namespace ovkc {

// What a policy needs to know of the model and the pool to check its fields.
struct ModelShape {
    int layers = 0;
    int q_heads = 0;
    int kv_heads = 0;
    int head_dim = 0;
    int block_size = 0;
};

class Spec {
public:
    explicit Spec(const std::string& text);

    // The field as an integer in [lo, hi].
    int64_t integer(const std::string& key, int64_t lo, int64_t hi);
    // 0 or 1.
    bool flag(const std::string& key);
    // One of `allowed`.
    std::string choice(const std::string& key, std::initializer_list<const char*> allowed);
    // A comma-separated list of integers in [lo, hi] (possibly empty).
    std::vector<int64_t> integers(const std::string& key, int64_t lo, int64_t hi);
    // The field as it is.
    std::string text(const std::string& key);
    // A comma-separated list of words (possibly empty).
    std::vector<std::string> words(const std::string& key);
    // Throws for the first field nobody took (a typo, or a field this method does not have).
    void finish() const;

    // "method.<field>=<value> is invalid: allowed <allowed>", the message every check uses.
    static std::string invalid(const std::string& field, const std::string& value, const std::string& allowed);

private:
    const std::string& take(const std::string& key);
    std::map<std::string, std::string> fields_;
    std::map<std::string, bool> taken_;
};

// Split `s` at `sep` (an empty string gives no items).
std::vector<std::string> split(const std::string& s, char sep);

}  // namespace ovkc
