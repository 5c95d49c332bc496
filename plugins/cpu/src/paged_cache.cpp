#include "paged_cache.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "policy.hpp"

namespace ovkc {

namespace {
std::string range(const char* field, int64_t value, const char* allowed) {
    return std::string(field) + "=" + std::to_string(value) + " is invalid: allowed " + allowed;
}
}  // namespace

void PoolConfig::validate() const {
    if (layers < 1 || layers > 4096) throw Error(range("layers", layers, "1..4096"));
    if (kv_heads < 1 || kv_heads > 1024) throw Error(range("kv_heads", kv_heads, "1..1024"));
    if (q_heads < kv_heads || q_heads % kv_heads != 0 || q_heads > 8192)
        throw Error(range("q_heads", q_heads, "a multiple of kv_heads, at most 8192"));
    if (head_dim < 16 || head_dim > 512 || head_dim % 16 != 0)
        throw Error(range("head_dim", head_dim, "a multiple of 16 in 16..512"));
    if (block_size < 16 || block_size > 256 || block_size % 16 != 0)
        throw Error(range("block_size", block_size, "a multiple of 16 in 16..256"));
    if (max_blocks < 0) throw Error(range("max_blocks", max_blocks, ">= 0 (0: unlimited)"));
    if (!windows.empty() && static_cast<int>(windows.size()) != layers)
        throw Error("windows has " + std::to_string(windows.size()) + " entries: allowed one per layer (" +
                    std::to_string(layers) + ") or none");
    for (int64_t w : windows)
        if (w < 0) throw Error(range("windows", w, ">= 0 (0: a global layer)"));
    sparse.validate();
    if (policy && scores && !policy->allows_score_output())
        throw Error("scores=1 is invalid with method " + policy->name() +
                    ": allowed 0 (its slot scores are its own, or its decode steps attend a recalled subset)");
}

int PoolConfig::quant_group() const { return policy && policy->quant() ? static_cast<int>(policy->quant_group()) : 16; }
int PoolConfig::quant_key_bits() const { return policy && policy->quant() ? policy->quant_key_bits() : 2; }
int PoolConfig::quant_value_bits() const { return policy && policy->quant() ? policy->quant_value_bits() : 2; }

size_t PoolConfig::qblock_bytes() const {
    const size_t bs = static_cast<size_t>(block_size), D = static_cast<size_t>(head_dim);
    const size_t g = static_cast<size_t>(quant_group());
    const size_t kb = static_cast<size_t>(quant_key_bits()), vb = static_cast<size_t>(quant_value_bits());
    return D * bs * kb / 8 + 4 * (bs / g) * D + bs * D * vb / 8 + 4 * bs * (D / g);
}

bool PoolConfig::keeps_scores() const { return scores || policy->keeps_slot_scores(); }

Pool::Pool(const PoolConfig& cfg) : cfg_(cfg) {
    if (!cfg_.policy) throw Error("a KV pool needs a method (policy)");
    cfg_.validate();
    fp_.bytes = cfg_.block_bytes();
    q_.bytes = cfg_.qblock_bytes();
}

Pool::~Pool() {
    for (auto* p : fp_.storage) std::free(p);
    for (auto* p : q_.storage) std::free(p);
}

int64_t Pool::allocated_bytes() const {
    return fp_.allocated * static_cast<int64_t>(fp_.bytes) + q_.allocated * static_cast<int64_t>(q_.bytes);
}

int32_t Pool::take(Blocks& b, Blocks& other, const char* what) {
    std::lock_guard<std::mutex> lock(mu_);
    int32_t id;
    if (!b.free.empty()) {
        id = b.free.back();
        b.free.pop_back();
    } else {
        const int64_t limit = cfg_.max_blocks * static_cast<int64_t>(fp_.bytes);
        const int64_t need = static_cast<int64_t>(b.bytes);
        while (cfg_.max_blocks && allocated_bytes() + need > limit && !other.free.empty()) {
            const int32_t spare = other.free.back();  // the other kind's unused memory makes room
            other.free.pop_back();
            std::free(other.storage[static_cast<size_t>(spare)]);
            other.storage[static_cast<size_t>(spare)] = nullptr;
            other.vacant.push_back(spare);
            --other.allocated;
        }
        if (cfg_.max_blocks && allocated_bytes() + need > limit)
            throw Error("KV block pool exhausted: max_blocks=" + std::to_string(cfg_.max_blocks) + " blocks of " +
                        std::to_string(cfg_.block_size) + " tokens (" + std::to_string(limit) +
                        " bytes, 2-bit blocks counted by their bytes) are all in use; raise max_kv_blocks or free sequences");
        if (b.vacant.empty() && b.storage.size() >= static_cast<size_t>(INT32_MAX))
            throw Error(std::string("KV block pool: too many ") + what + "s");
        void* p = std::aligned_alloc(64, (b.bytes + 63) / 64 * 64);
        if (!p) throw Error(std::string("KV block pool: out of memory allocating a ") + what);
        if (!b.vacant.empty()) {
            id = b.vacant.back();
            b.vacant.pop_back();
            b.storage[static_cast<size_t>(id)] = static_cast<uint8_t*>(p);
        } else {
            b.storage.push_back(static_cast<uint8_t*>(p));
            id = static_cast<int32_t>(b.storage.size() - 1);
        }
        ++b.allocated;
    }
    ++b.in_use;
    b.peak = std::max(b.peak, b.in_use);
    return id;
}

void Pool::give(Blocks& b, int32_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    b.free.push_back(id);
    --b.in_use;
}

int32_t Pool::acquire() { return take(fp_, q_, "block"); }
void Pool::release(int32_t block) { give(fp_, block); }
int32_t Pool::acquire_q() { return take(q_, fp_, "2-bit block"); }
void Pool::release_q(int32_t block) { give(q_, block); }

int64_t Pool::blocks_in_use() const {
    std::lock_guard<std::mutex> lock(mu_);
    return fp_.in_use;
}

int64_t Pool::qblocks_in_use() const {
    std::lock_guard<std::mutex> lock(mu_);
    return q_.in_use;
}

int64_t Pool::blocks_allocated() const {
    std::lock_guard<std::mutex> lock(mu_);
    return fp_.allocated;
}

int64_t Pool::peak_blocks() const {
    std::lock_guard<std::mutex> lock(mu_);
    return fp_.peak;
}

Sequence::Sequence(int64_t id, std::shared_ptr<Pool> pool)
    : id_(id),
      pool_(std::move(pool)),
      heads_(static_cast<size_t>(pool_->config().layers) * pool_->config().kv_heads),
      seen_(static_cast<size_t>(pool_->config().layers), 0) {}

Sequence::~Sequence() { reset(); }

int64_t Sequence::blocks_held() const {
    int64_t n = 0;
    for (const auto& h : heads_) n += static_cast<int64_t>(h.blocks.size());
    return n;
}

int64_t Sequence::qblocks_held() const {
    int64_t n = 0;
    for (const auto& h : heads_) n += static_cast<int64_t>(h.qblocks.size());
    return n;
}

int64_t Sequence::bytes_held() const {
    const auto& cfg = pool_->config();
    return blocks_held() * static_cast<int64_t>(cfg.block_bytes()) +
           qblocks_held() * static_cast<int64_t>(cfg.qblock_bytes());
}

void Sequence::reserve(HeadCache& hc, int64_t n) {
    const int64_t bs = pool_->config().block_size;
    const int64_t need = (hc.size() + n + bs - 1) / bs;
    while (static_cast<int64_t>(hc.blocks.size()) < need) hc.blocks.push_back(pool_->acquire());
}

void Sequence::trim_blocks(HeadCache& hc) {
    const int64_t bs = pool_->config().block_size;
    const size_t blocks = static_cast<size_t>((hc.size() + bs - 1) / bs);
    while (hc.blocks.size() > blocks) {
        pool_->release(hc.blocks.back());
        hc.blocks.pop_back();
    }
}

void Sequence::reset() {
    prompt_end = 0;
    scoring = false;
    for (auto& h : heads_) {
        for (int32_t b : h.blocks) pool_->release(b);
        for (int32_t b : h.qblocks) pool_->release_q(b);
        h.blocks.clear();
        h.qblocks.clear();
        h.qpos.clear();
        h.qscores.clear();
        h.pos.clear();
        h.scores.clear();
        h.degree.clear();
        h.bias.clear();
        h.holes = 0;
        h.pin_begin = h.pin_count = 0;
        h.state.reset();
    }
    std::fill(seen_.begin(), seen_.end(), 0);
    policy_ns[0] = policy_ns[1] = scores_ns[0] = scores_ns[1] = 0;
    append_ns[0] = append_ns[1] = attend_ns[0] = attend_ns[1] = 0;
    sparse_blocks[0] = sparse_blocks[1] = sparse_ns = 0;
}

void Sequence::truncate(int64_t tokens) {
    prompt_end = 0;
    scoring = false;
    const int G = pool_->config().group();
    for (auto& h : heads_)
        if (!h.qpos.empty() && h.qpos.back() >= tokens)
            throw Error("cannot truncate to " + std::to_string(tokens) +
                        " tokens: the 2-bit store holds later tokens (reset and prefill again)");
    for (auto& h : heads_)
        if (std::any_of(h.degree.begin(), h.degree.end(), [](float w) { return w != 1.0f; }))
            throw Error("cannot truncate to " + std::to_string(tokens) +
                        " tokens: Chelsea has merged tokens (reset and prefill again)");
    for (auto& h : heads_)
        if (h.state) h.state->check_truncate(tokens);
    const auto& cfg = pool_->config();
    for (int layer = 0; layer < cfg.layers; ++layer) {
        const int64_t w = cfg.window(layer);
        const HeadCache& h = head(layer, 0);
        // the next query (at `tokens`) sees (tokens - w, tokens]: those must still be in the ring
        if (w > 0 && tokens < seen_[static_cast<size_t>(layer)] && !h.pos.empty() && h.pos.front() > std::max<int64_t>(0, tokens - w + 1))
            throw Error("cannot truncate to " + std::to_string(tokens) + " tokens: sliding-window layer " +
                        std::to_string(layer) + " keeps positions from " + std::to_string(h.pos.front()) +
                        " only (reset and prefill again)");
    }
    for (auto& h : heads_) {
        // every kept token is in the slots before every dropped one (positions ascend, but for
        // a method that reorders older slots, e.g. ClusterKV's clusters, all older than the pending ones)
        const auto keep = std::count_if(h.pos.begin(), h.pos.end(), [&](int64_t p) { return p < tokens; });
        h.pos.resize(static_cast<size_t>(keep));
        if (!h.scores.empty()) h.scores.resize(static_cast<size_t>(keep) * G);
        if (!h.degree.empty()) h.degree.resize(static_cast<size_t>(keep));
        if (!h.bias.empty()) h.bias.resize(static_cast<size_t>(keep));
        h.holes = std::count(h.bias.begin(), h.bias.end(), HeadCache::kHole);  // holes stay masked
        h.pin_count = std::max<int64_t>(0, std::min(h.pin_count, keep - h.pin_begin));  // pinned slots kept
        if (!h.pin_count) h.pin_begin = 0;
        if (h.state) h.state->truncated();
        trim_blocks(h);
    }
    for (auto& s : seen_) s = std::min(s, tokens);
}

Registry& Registry::get() {
    static Registry r;
    return r;
}

int64_t Registry::create_pool(const PoolConfig& cfg) {
    auto p = std::make_shared<Pool>(cfg);
    std::lock_guard<std::mutex> lock(mu_);
    int64_t id = next_++;
    pools_.emplace_back(id, std::move(p));
    return id;
}

void Registry::free_pool(int64_t id) {
    std::shared_ptr<Pool> victim;
    std::vector<std::shared_ptr<Sequence>> seqs;
    {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = std::find_if(pools_.begin(), pools_.end(), [&](auto& e) { return e.first == id; });
        if (it == pools_.end()) throw Error("unknown KV pool handle " + std::to_string(id));
        victim = it->second;
        pools_.erase(it);
        // sequences of a freed pool go with it
        for (auto s = seqs_.begin(); s != seqs_.end();) {
            if (s->second->pool_ptr() == victim) {
                seqs.push_back(s->second);
                s = seqs_.erase(s);
            } else {
                ++s;
            }
        }
    }
}

std::shared_ptr<Pool> Registry::pool(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& e : pools_)
        if (e.first == id) return e.second;
    throw Error("unknown KV pool handle " + std::to_string(id));
}

int64_t Registry::create_sequence(int64_t pool_id) {
    auto p = pool(pool_id);
    std::lock_guard<std::mutex> lock(mu_);
    int64_t id = next_++;
    seqs_.emplace_back(id, std::make_shared<Sequence>(id, std::move(p)));
    return id;
}

void Registry::free_sequence(int64_t id) {
    std::shared_ptr<Sequence> victim;  // destroyed (blocks released) outside the registry lock
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::find_if(seqs_.begin(), seqs_.end(), [&](auto& e) { return e.first == id; });
    if (it == seqs_.end()) throw Error("unknown KV sequence handle " + std::to_string(id));
    victim = it->second;
    seqs_.erase(it);
}

std::shared_ptr<Sequence> Registry::sequence(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& e : seqs_)
        if (e.first == id) return e.second;
    throw Error("unknown KV sequence handle " + std::to_string(id) +
                " (create one with the pipeline's session API before running the model)");
}

void Registry::record_step_error(const std::vector<int64_t>& handles, const std::string& message) {
    std::lock_guard<std::mutex> lock(errors_mu_);
    for (int64_t h : handles) {
        auto it = std::find_if(errors_.begin(), errors_.end(), [h](const auto& e) { return e.first == h; });
        if (it == errors_.end())
            errors_.emplace_back(h, message);
        else
            it->second = message;  // the latest step's
    }
}

std::string Registry::take_step_error(int64_t handle) {
    std::lock_guard<std::mutex> lock(errors_mu_);
    auto it = std::find_if(errors_.begin(), errors_.end(), [handle](const auto& e) { return e.first == handle; });
    if (it == errors_.end()) return {};
    std::string message = std::move(it->second);
    errors_.erase(it);
    return message;
}

int64_t Registry::sequences_of(const Pool* pool) {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t n = 0;
    for (auto& e : seqs_)
        if (&e.second->pool() == pool) ++n;
    return n;
}

}  // namespace ovkc
