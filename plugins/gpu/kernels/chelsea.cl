// Chelsea's merge of a layer's rows after a prompt was attended (chelsea.h's merge_row, as the
// GPU plugin's merge layer runs it for a decode step): row r's MERGE_WIDTH fields are merge's row
// r, its blocks tables' row r (table_width apart), its protect scores the sum of scores_in's rows
// [r * score_rows, + score_rows), score_stride floats apart (score_rows 0: none), its degrees 1
// before the merge; its degrees and scores go to its runs of `index` (the words of
// IndexArena). Global (SG, rows), local (SG, 1): a sub-group a row.
#include "chelsea.h"

__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void merge_rows(__global uchar* pool, __global const int* tables, int table_width, __global uchar* index,
                         __global const int* merge, __global int* scratch, __global const float* scores_in,
                         int score_rows, int score_stride) {
    const int row = get_global_id(1);
    __global const int* mv = merge + row * MERGE_WIDTH;
    if (!mv[M_HELD]) return;
    __global float* words = (__global float*)index;
    merge_row(pool, tables + row * table_width, mv, 0,
              score_rows ? scores_in + (long)row * score_rows * score_stride : 0, score_rows, score_stride,
              mv[M_DEGREES] >= 0 ? words + mv[M_DEGREES] : 0, mv[M_SCORES] >= 0 ? words + mv[M_SCORES] : 0,
              scratch + mv[M_SCRATCH]);
}
