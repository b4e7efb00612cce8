"""`elastic bench-control`: what live mode's control plane costs a step, and how that grows with the job.

Two halves, because thousands of ranks cannot each be a process on one machine:
  store_share  the launcher's store at full N: simulated ranks (threads in a few processes, each with its own
               connection) run what they send the store through the real code (launcher.runtime.vote,
               launcher.runtime.events, launcher.wire.control), against a real server in its own process;
  groups       the vote's point-to-point messages on real gloo process groups of the sizes this machine holds.
A per-step figure at N is the store's share measured at N plus the messages' part, extrapolated from the
groups by the number of rounds the protocol takes (2 * ceil(log2 N) hops on the critical path).
"""
