"""Developer tools: checks and runs that drive whole engines, each runnable as
``python -m ov_kvcrush.tools.<name>``. They sit above every engine (nothing in the package
imports them), as the ``ov-kvcrush`` commands do:

* ``gpu_generate``: the Intel GPU path's device cache (``paged_device``) against the reference,
  token by token, with the bytes each step moves;
* ``gpu_hardware``: the check for people with an Intel GPU (every path's tokens against the CPU op's);
* ``gpu_plugin_check``: the exported model in OpenVINO's GPU plugin with our layers, against the CPU op;
* ``gpu_native``: native ``openvino_genai`` on the emulated GPU beside CPU;
* ``model_coverage``, ``model_coverage_table``: every model family checked end to end, and the
  tables and exports drawn from those checks.
"""
