//! The client's and the operator's side of the router: the listeners and
//! their connection handling (`server/`: accept loops, HTTP/1.1 and HTTP/2,
//! the layers every client request passes, `gate.rs`), the routes (`routes/`: OpenAI,
//! Responses, Messages, passthrough, registration, admin, probes), who may
//! call what (`secrets.rs`: tokens compared in constant time), and the state
//! the routes read (`app.rs`: `AppState` and the parts a handler takes alone;
//! `body_budget.rs`: the request body bytes in flight).

pub mod app;
pub mod body_budget;
pub mod gate;
pub mod held_body;
pub mod routes;
pub mod secrets;
pub mod server;
