"""What users touch: the decorator and ``compile()``, the capture backend, config presets and the
``hcompile`` command line. May import every other package."""
