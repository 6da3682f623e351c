"""Reports people look at: what a plan does, drawn with the tools they already use.

- ``subject``: a plan file or a model, resolved into its fused graph, memory plan and launch list,
  and each launch named after the ops it fuses;
- ``trace``: a Chrome/Perfetto trace (Trace Event Format JSON) of one run, one slice per launch;
- ``nvtx``: NVTX ranges around launches (``FUSEC_NVTX=1`` or ``Plan.run(..., nvtx=True)``);
- ``export_graph``: the fused graph as ONNX, fused nodes as ``ai.fusec`` nodes (Netron shows them);
- ``timeline``: live arena bytes over the launch order, as a self-contained HTML page (inline SVG)
  or a PNG (matplotlib, the ``[plot]`` extra).
"""
