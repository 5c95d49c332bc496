"""The Python side of our paged-attention op (the C++ extension in ``plugins/cpu``): building and
loading it (:mod:`~ov_kvcrush.op.plugin`), its C API's pool and sequences
(:mod:`~ov_kvcrush.op.kvcache`), a method's config as the op's spec string
(:mod:`~ov_kvcrush.op.method_spec`), and the op's KV bytes measured on random keys
(:mod:`~ov_kvcrush.op.probe`).
"""
