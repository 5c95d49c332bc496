"""The models the engines run: the embedded ones (:mod:`~ov_kvcrush.models.embedded`), a GGUF or
Hugging Face checkpoint exported to OpenVINO IR or converted for the torch engine
(:mod:`~ov_kvcrush.models.export`, through ``optimum-cli`` in a child process:
:mod:`~ov_kvcrush.models.optimum_child`), a SentencePiece GGUF's tokenizer rebuilt
(:mod:`~ov_kvcrush.models.gguf_tokenizer`), and the staging folders an interrupted export
leaves nothing half-written in (:mod:`~ov_kvcrush.models.staging`).
"""
