#include "spec.hpp"

#include <cstdlib>

#include "paged_cache.hpp"

namespace ovkc {

std::vector<std::string> split(const std::string& s, char sep) {
    std::vector<std::string> out;
    if (s.empty()) return out;
    size_t start = 0;
    while (true) {
        const size_t at = s.find(sep, start);
        out.push_back(s.substr(start, at == std::string::npos ? std::string::npos : at - start));
        if (at == std::string::npos) break;
        start = at + 1;
    }
    return out;
}

std::string Spec::invalid(const std::string& field, const std::string& value, const std::string& allowed) {
    return "method." + field + "=" + value + " is invalid: allowed " + allowed;
}

Spec::Spec(const std::string& text) {
    for (const auto& item : split(text, ';')) {
        if (item.empty()) continue;
        const size_t eq = item.find('=');
        if (eq == std::string::npos) throw Error("method spec item '" + item + "' is invalid: allowed key=value");
        const std::string key = item.substr(0, eq);
        if (fields_.count(key)) throw Error("method spec key '" + key + "' is given twice");
        fields_[key] = item.substr(eq + 1);
        taken_[key] = false;
    }
}

const std::string& Spec::take(const std::string& key) {
    auto it = fields_.find(key);
    if (it == fields_.end()) throw Error(invalid(key, "(missing)", "a value: the Python side sends every field"));
    taken_[key] = true;
    return it->second;
}

int64_t Spec::integer(const std::string& key, int64_t lo, int64_t hi) {
    const std::string& v = take(key);
    char* end = nullptr;
    const long long x = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || x < lo || x > hi)
        throw Error(invalid(key, v, "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]"));
    return x;
}

bool Spec::flag(const std::string& key) { return integer(key, 0, 1) != 0; }

std::string Spec::choice(const std::string& key, std::initializer_list<const char*> allowed) {
    const std::string& v = take(key);
    std::string names;
    for (const char* a : allowed) {
        if (v == a) return v;
        names += (names.empty() ? "" : ", ") + std::string(a);
    }
    throw Error(invalid(key, v, names));
}

std::vector<int64_t> Spec::integers(const std::string& key, int64_t lo, int64_t hi) {
    const std::string v = take(key);
    std::vector<int64_t> out;
    for (const auto& item : split(v, ',')) {
        char* end = nullptr;
        const long long x = std::strtoll(item.c_str(), &end, 10);
        if (item.empty() || *end != '\0' || x < lo || x > hi)
            throw Error(invalid(key, item, "integers in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]"));
        out.push_back(x);
    }
    return out;
}

std::string Spec::text(const std::string& key) { return take(key); }

std::vector<std::string> Spec::words(const std::string& key) { return split(take(key), ','); }

void Spec::finish() const {
    for (const auto& [key, taken] : taken_)
        if (!taken) throw Error("method spec key '" + key + "' is unknown to this method");
}

}  // namespace ovkc
