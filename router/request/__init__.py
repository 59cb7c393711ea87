"""The request core, one obvious place for each part of a request's path:

- ``call``: the core's own request (what every door translates into) and its answers;
- ``walk`` (the state machine; ``moves``, what it hears and asks), ``policy`` (what it is
  told), ``selection`` (evaluate and select), ``decision`` (after a failure),
  ``worst_case``, ``resume``, ``classify``, ``output_check``: pure decisions;
- ``records`` (one builder per event), ``final_error`` (the error answered): pure;
- ``executor``: the walk carried out through ``ports``, with ``routing`` (evaluation and
  admission), ``runner`` (an attempt's run), ``relay`` (the stream to the client),
  ``journal`` (the request's appends), ``endings`` (how attempts and the request end),
  ``budget`` (a request's holds);
- ``gateway``: one config generation, composing the ports each request is given.
"""
