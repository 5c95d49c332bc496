#include "method.hpp"

#include <cstdlib>
#include <map>

#include "paged_cache.hpp"

namespace ovkc {

namespace {

std::string invalid(const std::string& field, const std::string& value, const std::string& allowed) {
    return "method." + field + "=" + value + " is invalid: allowed " + allowed;
}

int64_t to_int(const std::string& field, const std::string& v, int64_t lo, int64_t hi) {
    char* end = nullptr;
    const long long x = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || x < lo || x > hi)
        throw Error(invalid(field, v, "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]"));
    return x;
}

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

const std::map<std::string, Method>& methods() {
    static const std::map<std::string, Method> m = {
        {"full", Method::full},       {"streamingllm", Method::streamingllm}, {"h2o", Method::h2o},
        {"snapkv", Method::snapkv},   {"pyramidkv", Method::pyramidkv},       {"kvcrush", Method::kvcrush},
        {"clusterkv", Method::clusterkv}, {"chelsea", Method::chelsea},       {"minikv", Method::minikv}};
    return m;
}

}  // namespace

MethodParams MethodParams::parse(const std::string& spec, int layers, int q_heads, int kv_heads, int block_size,
                                 int head_dim) {
    MethodParams p;
    std::map<std::string, std::string> kv;
    for (const auto& item : split(spec, ';')) {
        if (item.empty()) continue;
        const size_t eq = item.find('=');
        if (eq == std::string::npos) throw Error("method spec item '" + item + "' is invalid: allowed key=value");
        kv[item.substr(0, eq)] = item.substr(eq + 1);
    }
    auto take = [&](const std::string& key) -> const std::string* {
        auto it = kv.find(key);
        return it == kv.end() ? nullptr : &it->second;
    };
    const int64_t kMax = int64_t(1) << 20;
    if (auto* v = take("method")) {
        auto it = methods().find(*v);
        if (it == methods().end())
            throw Error(invalid("method", *v, "full, streamingllm, h2o, snapkv, pyramidkv, kvcrush, clusterkv, chelsea, minikv"));
        p.method = it->second;
        p.name = *v;
    }
    if (auto* v = take("budgets")) {
        for (const auto& b : split(*v, ',')) p.budgets.push_back(to_int("budgets", b, 0, kMax));
        if (static_cast<int>(p.budgets.size()) != layers)
            throw Error(invalid("budgets", std::to_string(p.budgets.size()) + " entries",
                                "one per layer (" + std::to_string(layers) + ")"));
    } else if (p.method != Method::full) {
        throw Error(invalid("budgets", "(missing)", "one budget per layer"));
    }
    if (auto* v = take("sinks")) p.sinks = to_int("sinks", *v, 0, kMax);
    if (auto* v = take("recent")) p.recent = to_int("recent", *v, 0, kMax);
    if (auto* v = take("scoring")) {
        if (*v == "none") p.scoring = Scoring::none;
        else if (*v == "h2o") p.scoring = Scoring::h2o;
        else if (*v == "snapkv") p.scoring = Scoring::snapkv;
        else throw Error(invalid("scoring", *v, "none, h2o, snapkv"));
    }
    if (auto* v = take("window")) p.window = to_int("window", *v, 1, 1 << 16);
    if (auto* v = take("pool_kernel")) {
        p.pool_kernel = to_int("pool_kernel", *v, 1, 129);
        if (p.pool_kernel % 2 == 0) throw Error(invalid("pool_kernel", *v, "an odd integer in [1, 129]"));
    }
    if (auto* v = take("pool")) {
        if (*v != "max" && *v != "avg") throw Error(invalid("pool", *v, "max, avg"));
        p.pool_avg = *v == "avg";
    }
    if (auto* v = take("frozen")) p.frozen = to_int("frozen", *v, 0, 1) != 0;
    if (auto* v = take("representatives")) p.representatives = to_int("representatives", *v, 0, kMax);
    if (auto* v = take("signature")) {
        if (*v != "topk" && *v != "threshold") throw Error(invalid("signature", *v, "topk, threshold"));
        p.signature_threshold = *v == "threshold";
    }
    if (auto* v = take("multi_anchor")) {
        if (*v != "tuple" && *v != "nearest") throw Error(invalid("multi_anchor", *v, "tuple, nearest"));
        p.multi_nearest = *v == "nearest";
    }
    if (auto* v = take("representative")) {
        if (*v != "max_score" && *v != "first") throw Error(invalid("representative", *v, "max_score, first"));
        p.representative_first = *v == "first";
    }
    if (auto* v = take("block_wise")) p.block_wise = to_int("block_wise", *v, 0, 1) != 0;
    if (auto* v = take("anchors")) {
        for (const auto& a : split(*v, ',')) {
            Anchor anchor;
            if (a == "mean") {
                anchor.mean = true;
            } else {
                if (static_cast<int>(a.size()) != q_heads || a.find_first_not_of("01") != std::string::npos)
                    throw Error(invalid("anchors", a, "mean or a string of " + std::to_string(q_heads) + " bits (one per query head)"));
                for (char c : a) anchor.bits.push_back(c == '1');
            }
            p.anchors.push_back(anchor);
        }
    }
    if (auto* v = take("quant")) p.quant = to_int("quant", *v, 0, 1) != 0;
    if (auto* v = take("group")) p.group = to_int("group", *v, 16, 128);
    if (auto* v = take("residual")) p.residual = to_int("residual", *v, 16, 1 << 16);
    if (auto* v = take("tokens_per_cluster")) p.tokens_per_cluster = to_int("tokens_per_cluster", *v, 1, kMax);
    if (auto* v = take("n_clusters")) p.n_clusters = to_int("n_clusters", *v, 0, kMax);
    if (auto* v = take("new_clusters")) p.new_clusters = to_int("new_clusters", *v, 1, kMax);
    if (auto* v = take("cluster_every")) p.cluster_every = to_int("cluster_every", *v, 1, 1 << 16);
    if (auto* v = take("max_iters")) p.max_iters = to_int("max_iters", *v, 1, 10000);
    if (auto* v = take("seed")) p.seed = to_int("seed", *v, 0, (int64_t(1) << 31) - 1);
    if (auto* v = take("cache_steps")) p.cache_steps = to_int("cache_steps", *v, 0, 1 << 16);
    if (auto* v = take("chunk")) {
        p.chunk = to_int("chunk", *v, 2, 1 << 16);
        if (p.chunk % 2) throw Error(invalid("chunk", *v, "an even integer in [2, 65536]"));
    }
    if (auto* v = take("merge_interval")) p.merge_interval = to_int("merge_interval", *v, 1, 1 << 16);
    if (auto* v = take("outliers")) {
        for (const auto& x : split(*v, ',')) p.outliers.push_back(to_int("outliers", x, 0, 1 << 16));
        if (p.outliers.size() % 2) throw Error(invalid("outliers", *v, "(layer, kv_head) pairs"));
        for (size_t i = 0; i < p.outliers.size(); i += 2)
            if (p.outliers[i] >= layers || p.outliers[i + 1] >= kv_heads)
                throw Error(invalid("outliers", *v, "layer < " + std::to_string(layers) + " and kv_head < " + std::to_string(kv_heads)));
    }
    for (const auto& [key, value] : kv) {
        static const char* known[] = {"method", "budgets", "sinks", "recent", "scoring", "window", "pool_kernel", "pool",
                                      "frozen", "representatives", "signature", "multi_anchor", "representative",
                                      "block_wise", "anchors", "quant", "group", "residual", "tokens_per_cluster",
                                      "n_clusters", "new_clusters", "cluster_every", "max_iters", "seed", "cache_steps",
                                      "chunk", "merge_interval", "outliers"};
        bool ok = false;
        for (const char* k : known) ok = ok || key == k;
        if (!ok) throw Error("method spec key '" + key + "' is unknown");
    }
    // cross-field checks
    for (int l = 0; l < layers && p.evicts(); ++l) {
        const int64_t b = p.budget(l);
        if (b && b < p.sinks + p.recent)
            throw Error(invalid("budgets", std::to_string(b), "at least sinks + recent = " + std::to_string(p.sinks + p.recent)));
    }
    for (int l = 0; l < layers; ++l) {
        const int64_t b = p.budget(l);
        if (b && p.method == Method::clusterkv && b < p.sinks + 1)
            throw Error(invalid("budgets", std::to_string(b), "at least sinks + 1 = " + std::to_string(p.sinks + 1)));
        if (b && p.method == Method::chelsea && b < p.sinks + p.recent + 1)
            throw Error(invalid("budgets", std::to_string(b),
                                "at least sinks + recent + 1 = " + std::to_string(p.sinks + p.recent + 1)));
    }
    if (p.method == Method::kvcrush) {
        if (p.anchors.empty()) throw Error(invalid("anchors", "(none)", "one or more anchors"));
        if (p.frozen && p.block_wise) throw Error(invalid("block_wise", "1", "0 with the 2-bit store"));
    }
    if (p.quant) {
        if (head_dim % p.group) throw Error(invalid("group", std::to_string(p.group), "a divisor of head_dim=" + std::to_string(head_dim)));
        if (block_size % p.group)
            throw Error(invalid("group", std::to_string(p.group), "a divisor of the KV block size " + std::to_string(block_size)));
        if (p.residual % block_size)
            throw Error(invalid("residual", std::to_string(p.residual),
                                "a multiple of the KV block size " + std::to_string(block_size)));
    }
    return p;
}

}  // namespace ovkc
