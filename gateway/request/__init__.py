"""One request's path, step by step: the sequencer (``pipeline``) and its context, counting
(``tokenize``), the SLO decision (``slo``), routing and sending with retries and failover
(``dispatch``, ``attempt``, ``retry``, ``disagg``), the upstream client (``upstream``),
relaying and answering (``relay``, ``respond``, ``aggregate``, ``migrate``) and settling
(``settle``). ``serve`` and the EPP share every step."""
