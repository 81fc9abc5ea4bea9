"""The streamed model at run time: the load (``loader``), the paged MoE
layers and their slot pools (``block``, ``pool``, ``store``, ``policy``),
memory planning and pressure, the streamed spine, and statistics."""
