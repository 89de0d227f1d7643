"""Tools around the user API: ``hcompile profile`` (``profile``), ``hcompile plan`` (``simulate``), local
multi-rank jobs (``spawn``), progress bars (``progress``) and the command line's output files (``files``)."""
