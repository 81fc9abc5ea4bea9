"""What the runtime knows of mlx-lm's model families: where each keeps its
MoE layers, router and experts (``discover``), and MTP layers (``mtp_layers``)."""
