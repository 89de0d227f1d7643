"""FX graph passes: analysis (``analyze``), the runner (``pass_runner``), canonical attention
(``normalize``), tensor parallel (``sharding``, ``tensor_parallel``, ``collectives``), packed attention
(``packed_attention``), pipeline split (``pipeline_split``) and the compiled variants (``variant``)."""
