// Spherical (cosine) k-means: ClusterKV's clustering (kmeans.cpp).
#pragma once

#include <cstdint>
#include <vector>

namespace ovkc {

// Spherical k-means of n vectors x [n][D] into min(k, n) clusters (kmeans_cosine in the reference).
struct KMeans {
    int64_t k = 0;
    std::vector<int32_t> labels;   // [n]
    std::vector<float> centroids;  // [k][D]: plain mean of each cluster's vectors (zeros if empty)
    std::vector<int64_t> sizes;    // [k]
    int64_t iterations = 0;
    int64_t rows_assigned = 0;  // rows whose similarities were computed, over all iterations
};
// bounded=false recomputes every similarity at every iteration (the tests' oracle for the bounds).
KMeans kmeans_cosine(const float* x, int64_t n, int D, int64_t k, int64_t max_iters, int64_t seed, int64_t row,
                     bool bounded = true);
// The first k entries of the reference's init_order(seed)[row] (a seeded permutation of range(n)).
std::vector<int64_t> init_order(int64_t seed, int64_t row, int64_t n, int64_t k);

}  // namespace ovkc
