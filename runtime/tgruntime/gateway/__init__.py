"""The Tinker gateway: one endpoint for every TrainerGroup's Tinker server, routing each
request by its base model or by the id it names (docs/tinker.md, "One endpoint for the
cluster: the gateway"). Rooms: ``routing`` (pure: which route a request takes), ``groups``
(the group list), ``owners`` (what was learned of which group holds an id), ``upstream``
(calls to the groups), ``app`` (the aiohttp handler), ``__main__`` (the command)."""
