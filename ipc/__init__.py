"""What the server's processes agree on without Triton in between: files in ``/dev/shm`` and ``/proc``.

``cancel``: the board where postprocess marks a generation its client left (or failed) for llm to end;
``delivery``: the board where postprocess marks how far it has taken each stream, for llm's coalescing;
``drain_notice``: the notice whoever stops a tritonserver posts, and llm's note that it holds nothing;
``stubs``: which Python stub processes run, read from ``/proc`` (the only sign Triton 2.51 gives that a
stub died), and ``DeathWatch`` for the requests a dead stub stranded. Imported by the stubs' glue
(``triton_glue``), the launcher and the OpenAI front end; imports nothing of the project.
"""
