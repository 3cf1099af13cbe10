"""The multi-job scheduler in parts, one job each (``tidal.runtime.scheduler.Runtime`` composes
them): ``pieces`` (an iteration's pieces: ``tidal.ir.program.Piece`` objects paired with what
they run, and what the scheduler derives from a piece's kind and stream), ``jobs`` (what
``Runtime.submit`` takes), ``limits`` (AntMan's memory cap and compute share), ``handle`` (a
submitted job's queues), ``records`` (statistics and the trace), ``streams`` (the backend
streams of job roles), ``queues`` (building iterations and picking the next piece),
``timing`` (isolated durations and the slowdown feedback), ``idle`` (fitting background
pieces into the foreground's idle spans), ``gate`` (when a background piece may go: compute
share, feedback, idle spans) and ``runtime`` (the dispatch loop). ``alone`` dispatches one
program that runs alone (``ProgramRunner.launch``) straight onto the backend, without the
scheduler's queues."""
