//! `/images`: list, inspect, import and delete images.

use http::Method;
use http_body_util::BodyExt as _;
use tine_proto::api::{DeleteImageResponse, ImageInfo, ImportEvent, ImportFormat};
use tokio::io::AsyncRead;

use super::{reader_body, seg, ApiError, NdjsonDecoder, Query, Result, TineClient};

impl TineClient {
    /// `GET /images`: every recorded image.
    pub async fn list_images(&self) -> Result<Vec<ImageInfo>> {
        self.get("/images").await
    }

    /// `GET /images/{name}`.
    pub async fn image(&self, name: &str) -> Result<ImageInfo> {
        self.get(&format!("/images/{}", seg(name))).await
    }

    /// `DELETE /images/{name}`.
    pub async fn delete_image(&self, name: &str) -> Result<DeleteImageResponse> {
        self.call(Method::DELETE, &format!("/images/{}", seg(name)), None)
            .await
    }

    /// `POST /images?name=&format=`: streams `reader` as the image file and
    /// calls `on_event` with each progress event the daemon sends; returns
    /// the new image, or the daemon's error (an `error` event becomes
    /// [`ApiError::Api`] with status 400 or 500 by its code).
    pub async fn import_image<R>(
        &self,
        name: &str,
        format: ImportFormat,
        reader: R,
        mut on_event: impl FnMut(&ImportEvent),
    ) -> Result<ImageInfo>
    where
        R: AsyncRead + Send + 'static,
    {
        let path = Query::new()
            .add("name", name)
            .add("format", format.as_str())
            .finish("/images".to_owned());
        let response = self
            .send(
                Method::POST,
                &path,
                Some("application/octet-stream"),
                reader_body(reader),
            )
            .await?;
        let mut body = response.into_body();
        let mut lines = NdjsonDecoder::default();
        loop {
            while let Some(line) = lines.next_line() {
                let event: ImportEvent =
                    serde_json::from_slice(&line).map_err(|source| ApiError::Decode {
                        what: "an image import event".into(),
                        source,
                    })?;
                match event {
                    ImportEvent::Done { image } => return Ok(image),
                    ImportEvent::Error(body) => {
                        return Err(ApiError::Api {
                            status: body.code.http_status(),
                            body,
                        })
                    }
                    progress => on_event(&progress),
                }
            }
            match body.frame().await {
                Some(frame) => {
                    if let Ok(data) = frame?.into_data() {
                        lines.push(&data);
                    }
                }
                None => {
                    return Err(ApiError::Protocol(
                        "the image import's answer ended without a result".into(),
                    ))
                }
            }
        }
    }
}
